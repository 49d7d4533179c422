"""Attention's certified refinement: Arb balls for the elements the first pass left undecided.

Three steps, cheapest first, for each undecided element:

1. *Structural zeros.*  An element every term of which is exactly zero (a
   fully masked row, a zero column of V, a zero row of dO, ...) is +0.
2. *Arb.*  The element is computed in Arb ball arithmetic from the exact
   inputs, at 128 bits (every element has been through a second pass,
   which a 64-bit ball does not beat), then at twice the precision until its ball rounds to
   one value (:func:`exactref.engine.certified.round_certified`).  The work
   is per head: the logits Q K^T and the products with V, dO, K and Q are
   ``arb_mat`` products; an element of grad_key or grad_value, which needs
   every row of its head, comes from ``_wholehead``, where only the exps run
   one by one in Python.  The balls are decided in float64 where that
   suffices (:func:`_decide_many`), exactly otherwise.
3. *Exact analysis*, from the second precision on, to recognise the values
   that are exactly a rounding boundary or zero, which no precision
   separates from the boundary.  By the Lindemann-Weierstrass theorem,
   ``sum_g c_g exp(a_g)`` with distinct algebraic exponents a_g and
   algebraic c_g is zero only when every c_g is.  The logits are algebraic
   (the scale is rational or 1/sqrt(E)), so grouping the keys of a row by
   their exact logit decides whether the output, or the row's grad_query, is
   rational, and gives it.  A sum over several rows (grad_key, grad_value,
   and grad_query summed over broadcast copies) is decided this way only
   when every row it sums has rational weights (all its logits equal); if
   such a sum is exactly a boundary and some row's weights are
   transcendental, the precision cap raises ReferenceUnavailableError.
   Which rows contribute and which are rational is read from the first
   pass's enclosures, with exact arithmetic only where they overlap, so the
   analysis costs O(L S) float operations per head, not O(L S) Fractions
   per element.

Each step's work is estimated before it runs (:meth:`Refiner._cost`), and
one output may spend at most its budget: a step past it raises
ReferenceBudgetError instead of running for hours.

Past the first precision the Arb values are computed as an exact rational
part plus a remainder (``_split``), so a value off a boundary, or off zero,
by far less than 2**-4096 is still decided; at the cap a ball of unknown
sign proven to round to zero is +0.
"""

from __future__ import annotations

import math
from collections import defaultdict
from fractions import Fraction
from typing import Any

import flint
import numpy as np

from ...engine.certified import (
    MAX_PRECISION,
    START_PRECISION,
    Decision,
    precision,
    round_certified,
)
from ...engine.exact import exact_dot_rows
from ...errors import ReferenceBudgetError
from ...formats import Format
from ...rounding import decide, next_down, next_up
from ._first import FirstPass, dp_rows
from ._problem import Problem
from ._split import RowSplit, Split, decide_split
from ._wholehead import BULK, WholeHead, head_cost
from ._wholehead import int_matrix as _int_matrix

__all__ = ["Refiner"]

WHICH = ("out", "query", "key", "value")

#: The work (in units of about one 64-bit Arb exp: a microsecond or two) the refinement of one output
#: may do by default: a few minutes at most.
DEFAULT_BUDGET = float(2 ** 27)
_FRACTION = 24.0  # units per key and per pair of the split's Fraction arithmetic (measured: 1 to 6 us)
_REPORT_WORK = float(2 ** 22)  # the most work exact_value spends on a split before a direct ball
# Structural zeros are counted for every element at once (a few matrix products) when at least
# one element in this many is asked about; term by term for fewer.
_ZERO_COUNTS = 64


def _fraction(n: int, e: int) -> Fraction:
    return Fraction(n << e) if e >= 0 else Fraction(n, 1 << -e)


def _ball(x: Fraction) -> flint.arb:
    """An Arb ball of the rational x: exact when x is dyadic."""
    d = x.denominator
    if d & (d - 1) == 0:
        bits = abs(x.numerator).bit_length() + 8
        with precision(max(flint.ctx.prec, bits)):
            return flint.arb(flint.fmpz(x.numerator)) * flint.arb(2) ** (-(d.bit_length() - 1))
    return flint.arb(flint.fmpq(x.numerator, d))


def _arb_mat(a: np.ndarray) -> flint.arb_mat:
    rows, cols = a.shape
    return flint.arb_mat(rows, cols, a.reshape(-1).tolist())


def _decide_many(items: list[Any], fmt: Format) -> tuple[list[Decision | None], list[int]]:
    """The decision of each ball (or Split) that float64 arithmetic settles (None for the others),
    and the positions of the others.

    Each ball x is read as hi + lo +- rad: hi is its midpoint m rounded, the
    ball x - hi (midpoint m - hi, radius at least x's plus the rounding of
    m - hi) gives lo, its midpoint rounded (less than |lo| 2**-52 off), and
    rad, its radius rounded up; then :func:`exactref.rounding.decide`
    decides them all at once, as for the first pass; what it leaves goes to
    ``decide_split`` one by one.  Roughly ten times faster than deciding every ball exactly.
    """
    n = len(items)
    hi, lo, rad = [0.0] * n, [0.0] * n, [math.inf] * n  # (lists: numpy arrays at the end)
    for t, item in enumerate(items):
        ball = item.ball if isinstance(item, Split) else item
        if not ball.is_finite():
            continue
        h = float(ball)  # (the midpoint, rounded)
        if not (2.0 ** -960 < abs(h) < 2.0 ** 1000):
            continue  # near zero or float64's range: left to the exact decision
        dd = ball - h
        d = float(dd)
        hi[t], lo[t] = h, d
        rad[t] = float(dd.rad()) * (1 + 2.0 ** -50) + abs(d) * 2.0 ** -52 + 2.0 ** -1070
    hi, lo, rad = np.array(hi), np.array(lo), np.array(rad)
    with np.errstate(invalid="ignore", over="ignore"):
        rounded, ok = decide(hi, lo, rad, fmt)
        # The float64 neighbours of hi + lo -+ rad, as tight as an exact decision gives them, where
        # lo and rad are below hi's gaps (a 128-bit ball: always); looser bounds elsewhere.
        down, upper = next_down(hi), next_up(hi)
        spread = (np.abs(lo) + rad) * (1 + 2.0 ** -50)
        mid = hi + lo
        x_lo = np.where(lo >= rad, hi, np.where(spread <= hi - down, down, next_down(next_down(mid) - rad)))
        x_hi = np.where(-lo >= rad, hi, np.where(spread <= upper - hi, upper, next_up(next_up(mid) + rad)))
    # (Python floats by tolist: indexing numpy arrays element by element costs several times more.)
    out: list[Decision | None] = list(zip(rounded.tolist(), x_lo.tolist(), x_hi.tolist()))
    left = np.flatnonzero(~ok).tolist()
    for t in left:
        out[t] = None
    return out, left


class _Head:
    """Arb quantities of one head at one precision, computed for the rows asked for."""

    def __init__(self, ref: Refiner, h: int) -> None:
        pb, fp = ref.pb, ref.fp
        self.ref, self.h = ref, h
        self.Q, self.K, self.V = fp.Qh[h], fp.Kh[h], fp.Vh[h]
        self.Km = _arb_mat(self.K)
        self.Vm = _arb_mat(self.V)
        # Row i's normalised weights, shared with the other refinements of this problem.
        self.P: dict[int, list[flint.arb]] = fp.arb_weights.setdefault((h, flint.ctx.prec), {})
        self.s = pb.scale.ball()
        self._out: dict[int, list[flint.arb]] = {}
        self.dS_rows: dict[int, list[flint.arb]] = {}

    def weights(self, rows: list[int]) -> None:
        pb, fp = self.ref.pb, self.ref.fp
        todo = [i for i in rows if i not in self.P]
        if not todo:
            return
        S = pb.S
        # The scale multiplies the matrix in C (entry by entry, the same products as in Python).
        zero = flint.arb(0)
        logits = ((_arb_mat(self.Q[todo]) * self.Km.transpose()) * self.s).entries() if S and pb.E else \
            [zero] * (len(todo) * S)
        # (Rows as Python lists: indexing numpy arrays and arb_mat entries one by one costs more.)
        live_rows = fp.unmasked[self.h, todo].tolist()
        shifts = fp.M[self.h, todo].tolist()
        adds = pb.additive[self.h, todo].tolist() if pb.additive is not None else None
        for r, i in enumerate(todo):
            live = live_rows[r]
            if not any(live):
                self.P[i] = [zero] * S
                continue
            shift = flint.arb(shifts[r])
            z = logits[r * S:(r + 1) * S]
            if adds is not None:
                z = [x + a if a != 0 else x for x, a in zip(z, adds[r])]
            w = [(x - shift).exp() if u else zero for x, u in zip(z, live)]
            total = sum(w, zero)
            self.P[i] = [x / total if x is not zero else zero for x in w]

    def out(self, rows: list[int]) -> dict[int, list[flint.arb]]:
        todo = [i for i in rows if i not in self._out]
        if todo:
            self.weights(todo)
            Pm = flint.arb_mat(len(todo), self.ref.pb.S, [x for i in todo for x in self.P[i]])
            prod = (Pm * self.Vm).entries() if self.ref.pb.S else [flint.arb(0)] * (len(todo) * self.ref.pb.Ev)
            Ev = self.ref.pb.Ev
            for r, i in enumerate(todo):
                self._out[i] = prod[r * Ev:(r + 1) * Ev]
        return {i: self._out[i] for i in rows}

    def dS(self, rows: list[int]) -> dict[int, list[flint.arb]]:
        """dS_ij = P_ij (dP_ij - D_i), computed as P_ij (d_ij - sum_k P_ik d_ik) with d_ij = dP_ij - dP_ic.

        The differences d are exact (dP is exact), and the identity holds because
        the weights sum to 1; so a row whose dP is constant gets an exact zero, and
        nothing cancels when the weights are concentrated.
        """
        todo = [i for i in rows if i not in self.dS_rows]
        if todo:
            self.weights(todo)
            for i in todo:
                diffs, unit = self.ref.dP_differences(self.h, i)
                P = self.P[i]
                D = sum((p * d for p, d in zip(P, diffs) if not (p.is_zero() or d.is_zero())), flint.arb(0))
                self.dS_rows[i] = [p if p.is_zero() and p.is_exact() else p * (d - D) * unit
                                   for p, d in zip(P, diffs)]
        return {i: self.dS_rows[i] for i in rows}

    def grad_query(self, rows: list[int]) -> dict[int, list[flint.arb]]:
        pb = self.ref.pb
        dS = self.dS(rows)
        m = flint.arb_mat(len(rows), pb.S, [x for i in rows for x in dS[i]])
        prod = (m * self.Km).entries() if pb.S else [flint.arb(0)] * (len(rows) * pb.E)
        return {i: [self.s * x for x in prod[r * pb.E:(r + 1) * pb.E]] for r, i in enumerate(rows)}


class Refiner:
    """Decides the elements of attention's outputs that the first pass left undecided."""

    def __init__(self, pb: Problem, fp: FirstPass, op: str, G: np.ndarray | None,
                 budget: float = DEFAULT_BUDGET) -> None:
        self.pb, self.fp, self.op = pb, fp, op
        self.G = G  # the output gradient per head (H, L, Ev), or None for the forward
        # The work the Arb refinement of one output may do, in units of one exp at 64 bits (see _charge).
        self.budget = budget
        self._spent = 0.0
        self._start = START_PRECISION
        self._varies: dict[int, np.ndarray] = {}
        self._rational: dict[int, np.ndarray] = {}
        self._dP_rows: dict[tuple[int, int], tuple[list[Fraction], Fraction]] = {}
        self._heads: dict[tuple[int, int], _Head] = {}
        self._kv: dict[tuple[int, int], WholeHead] = {}
        self._exact: dict[tuple[str, int], tuple[str, Any]] = {}
        self._keys: dict[tuple[int, int], list[Any]] = {}
        self._dP: dict[int, tuple[list[list[flint.fmpz]], int]] = {}
        self._splits: dict[tuple[int, int, int, bool], RowSplit] = {}
        self._live: np.ndarray | None = None  # _live_rows, once

    # ------------------------------------------------------------------ shapes and names

    def _user_shape(self, which: str) -> tuple[int, ...]:
        return self.pb.out_shape if which == "out" else self.pb.shapes[which]

    def name(self, which: str) -> str:
        return self.op if which == "out" else f"{self.op}.backward grad_{which}"

    def index(self, which: str, flat: int) -> tuple[int, ...]:
        return tuple(int(i) for i in np.unravel_index(flat, self._user_shape(which)))

    # ------------------------------------------------------------------ step 1: structural zeros

    def structural_zeros(self, which: str, flat: np.ndarray) -> np.ndarray:
        """Bool per flat index: every term of the element is exactly zero."""
        b, r, c = np.unravel_index(flat, self.pb.flat_shape(which))
        if flat.size * _ZERO_COUNTS >= math.prod(self.pb.flat_shape(which)):
            # Many elements (a float64 output leaves them all): every element's count of nonzero
            # terms at once, as products of 0/1 matrices, exact in float64 whatever the order.
            return self._term_counts(which)[b, r, c] == 0
        return self._zero_terms(which, b, r, c)

    def _live_rows(self) -> np.ndarray:
        """(H, L): rows whose dS may be nonzero.  A row's dS vanishes when dO_i or V is zero, or when
        it has one key (its weight is exactly 1)."""
        if self._live is None:
            # Once per refiner: the mask's count alone reads every logit's entry (8 M at 1x8x1024x1024).
            fp = self.fp
            self._live = ((np.abs(self.G).sum(-1) > 0) & (np.abs(fp.Vh).sum(axis=(-1, -2)) > 0)[:, None]
                          & (fp.unmasked.sum(-1) > 1))
        return self._live

    def _term_counts(self, which: str) -> np.ndarray:
        """How many terms of each element of output ``which`` may be nonzero (see _zero_terms)."""
        pb, fp = self.pb, self.fp
        unm = fp.unmasked.astype(np.float64)
        if which == "out":
            return unm @ (fp.Vh != 0)
        if which != "value":
            unm = unm * self._live_rows()[..., None]
        cop = pb.copies(which)
        Y = {"query": fp.Kh, "key": fp.Qh, "value": self.G}[which] != 0
        X = unm if which == "query" else np.swapaxes(unm, -1, -2)
        return sum(X[cop[:, k]] @ Y[cop[:, k]] for k in range(cop.shape[1]))

    def _zero_terms(self, which: str, b: np.ndarray, r: np.ndarray, c: np.ndarray) -> np.ndarray:
        """:meth:`structural_zeros` of the elements (b, r, c), term by term."""
        pb, fp = self.pb, self.fp
        # The mask is read only at the elements' own terms: made float64 whole, it took 0.15 s of a
        # 1x8x1024x64 float32 backward, for 200 elements.
        unm = fp.unmasked
        if which == "out":
            return ~(unm[b, r] & (fp.Vh[b, :, c] != 0)).any(-1)
        cop = pb.copies(which)[b]  # (n, copies)
        G = self.G
        live_row = self._live_rows()  # (H, L)
        result = np.ones(len(b), dtype=bool)
        for k in range(cop.shape[1]):
            h = cop[:, k]
            if which == "query":
                terms = unm[h, r, :] & live_row[h, r][:, None] & (fp.Kh[h, :, c] != 0)
            elif which == "key":
                terms = unm[h, :, r] & live_row[h] & (fp.Qh[h, :, c] != 0)
            else:
                terms = unm[h, :, r] & (G[h, :, c] != 0)
            result &= ~terms.any(-1)
        return result

    # ------------------------------------------------------------------ step 2: Arb

    def _head(self, h: int) -> _Head:
        key = (h, flint.ctx.prec)
        if key not in self._heads:
            self._heads[key] = _Head(self, h)
        return self._heads[key]

    def _arb_values(self, which: str, flats: list[int]) -> dict[int, flint.arb]:
        pb = self.pb
        # (Indices and heads as arrays, looked up once: a float64 output asks for every element.)
        b, i, c = np.unravel_index(np.asarray(flats, dtype=np.int64), self.pb.flat_shape(which))
        cop = b[:, None] if which == "out" else pb.copies(which)[b]  # the heads each element sums over
        heads, count = (a.tolist() for a in np.unique(cop, return_counts=True))
        if which in ("out", "query"):
            got = {}
            for h in heads:
                rows = np.unique(i[(cop == h).any(axis=1)]).tolist()
                got[h] = self._head(h).out(rows) if which == "out" else self._head(h).grad_query(rows)

            def value(h: int, r: int, col: int) -> flint.arb:
                return got[h][r][col]
        else:
            whole = {h: self._whole_head(h) for h in heads}
            # A head asked for many elements computes its whole gradient (WholeHead.full).
            full = {h: whole[h].full(which) for h, n in zip(heads, count) if n > BULK}
            cols = pb.E if which == "key" else pb.Ev

            def value(h: int, r: int, col: int) -> flint.arb:
                return full[h][r * cols + col] if h in full else whole[h].element(which, r, col)
        rows_l, cols_l = i.tolist(), c.tolist()
        if cop.shape[1] == 1:
            # One head each (no grouped query heads): its value is the element's, as 0 + x would be.
            return {f: value(h, r, col) for f, h, r, col in zip(flats, cop[:, 0].tolist(), rows_l, cols_l)}
        return {f: sum((value(h, r, col) for h in hs), flint.arb(0))
                for f, hs, r, col in zip(flats, cop.tolist(), rows_l, cols_l)}

    def _whole_head(self, h: int) -> WholeHead:
        key = (h, flint.ctx.prec)
        if key not in self._kv:
            self._kv = {k: v for k, v in self._kv.items() if k[1] == flint.ctx.prec}  # free lower precisions
            self._kv[key] = WholeHead(self.pb, self.fp, self.G, h, self._heads.get(key))
        return self._kv[key]

    # ------------------------------------------------------------------ step 2b: R + eps (see _split)

    def _row_split(self, h: int, i: int, backward: bool) -> RowSplit:
        key = (h, i, flint.ctx.prec, backward)
        if key not in self._splits:
            dP = self._dP_exact(h, i) if backward else None
            self._splits[key] = RowSplit(self._logit_keys(h, i), self.pb.scale, dP)
        return self._splits[key]

    def _split_out(self, h: int, i: int, c: int) -> tuple[Fraction, flint.arb]:
        sp = self._row_split(h, i, False)
        if not sp.live:
            return Fraction(0), flint.arb(0)
        V = self.fp.Vh[h][:, c]
        R = sum((Fraction(float(V[j])) for j in sp.T), Fraction(0)) / sp.n
        # sum_j d_j v_j = sum_{k not in T} w_k (v_k - R) / W: the differences are exact.
        eps = sum((wk * _ball(Fraction(float(V[k])) - R) for k, wk in sp.w.items() if V[k] != R), flint.arb(0))
        return R, eps / sp.W

    def _split_query(self, h: int, i: int, c: int) -> tuple[Fraction, flint.arb]:
        """sum_j dS_ij k_jc as sum_{j<k} P_j P_k (dP_j - dP_k)(k_jc - k_kc): where two dominant keys
        share k_jc the direct sum cancels far below its terms, the pairwise one has nothing to cancel."""
        sp = self._row_split(h, i, True)
        g, K = self._dP_exact(h, i), self.fp.Kh[h][:, c]
        R, eps = Fraction(0), flint.arb(0)
        for a, j in enumerate(sp.live):
            for k in sp.live[a + 1:]:
                t = (g[j] - g[k]) * (Fraction(float(K[j])) - Fraction(float(K[k])))
                if t:
                    p0, pe = sp.pair_weight(j, k)
                    R, eps = R + p0 * t, eps + pe * _ball(t)
        return R, eps

    def _split_rows(self, which: str, h: int, r: int, c: int) -> tuple[Fraction, flint.arb]:
        """grad_value (P^T dO) or unscaled grad_key (dS^T Q) of key r, column c, from head h's rows."""
        R, eps = Fraction(0), flint.arb(0)
        Y = self.G[h] if which == "value" else self.fp.Qh[h]
        for i in np.flatnonzero(self.fp.unmasked[h, :, r]):
            x = Fraction(float(Y[i, c]))
            if x:
                sp = self._row_split(h, int(i), which == "key")
                p0, pe = (sp.P0[r], sp.d[r]) if which == "value" else (sp.dS0[r], sp.eps[r])
                R, eps = R + p0 * x, eps + pe * _ball(x)
        return R, eps

    def _split_values(self, which: str, flats: list[int]) -> dict[int, Split]:
        """Each element as its exact part R and remainder eps (``_split``), at the current precision."""
        pb = self.pb
        out = {}
        for f in flats:
            b, r, c = (int(x) for x in np.unravel_index(f, self.pb.flat_shape(which)))
            if which == "out":
                R, eps = self._split_out(b, r, c)
            else:
                R, eps = Fraction(0), flint.arb(0)
                for h in pb.copies(which)[b]:
                    R2, e2 = (self._split_query(int(h), r, c) if which == "query"
                              else self._split_rows(which, int(h), r, c))
                    R, eps = R + R2, eps + e2
            out[f] = self._split_item(which, R, eps)
        return out

    def _split_item(self, which: str, R: Fraction, eps: flint.arb) -> Split:
        sc = self.pb.scale
        if which in ("query", "key"):
            if sc.rational is None:
                # s R is irrational unless R = 0, so never a boundary: the ball decides it.
                s = sc.ball()
                return Split(s * (_ball(R) + eps), None, s * eps)
            R, eps = sc.rational * R, _ball(sc.rational) * eps
        return Split(_ball(R) + eps, R, eps)

    # ------------------------------------------------------------------ step 3: exact analysis

    def _logit_keys(self, h: int, i: int) -> list[Any]:
        """The exact logit of each key of row i (None where masked), as a hashable value."""
        if (h, i) in self._keys:
            return self._keys[(h, i)]
        pb, fp = self.pb, self.fp
        unm = fp.unmasked[h, i]
        S = pb.S
        q = np.broadcast_to(fp.Qh[h, i], (S, pb.E))
        dots = exact_dot_rows(q, fp.Kh[h]) if pb.E else [(0, 0)] * S
        keys: list[Any] = []
        for j in range(S):
            if not unm[j]:
                keys.append(None)
                continue
            d = _fraction(*dots[j])
            m = Fraction(float(pb.additive[h, i, j])) if pb.additive is not None else Fraction(0)
            keys.append(pb.scale.rational * d + m if pb.scale.rational is not None else (d, m))
        self._keys[(h, i)] = keys
        return keys

    def _row_rational(self, h: int, i: int) -> bool:
        keys = [k for k in self._logit_keys(h, i) if k is not None]
        return all(k == keys[0] for k in keys)

    def _dP_head(self, h: int) -> tuple[list[list[flint.fmpz]], int]:
        """dP = dO V^T of head h exactly: integers n_ij with dP_ij = n_ij * 2**base."""
        if h not in self._dP:
            pb = self.pb
            Gi, eg = _int_matrix(self.G[h])
            Vi, ev = _int_matrix(self.fp.Vh[h])
            if pb.Ev == 0 or pb.S == 0 or pb.L == 0:
                ints = [[flint.fmpz(0)] * pb.S for _ in range(pb.L)]
            else:
                flat = (Gi * Vi.transpose()).entries()
                ints = [flat[i * pb.S:(i + 1) * pb.S] for i in range(pb.L)]
            self._dP[h] = (ints, eg + ev)
        return self._dP[h]

    def dP_differences(self, h: int, i: int) -> tuple[list[flint.arb], flint.arb]:
        """Exact balls of (dP_ij - dP_ic) / 2**base for row i of head h, c its largest logit, and 2**base."""
        ints, base = self._dP_head(h)
        live = self.fp.unmasked[h, i]
        # The reference is the row's dominant key: its difference is exactly 0, so a weight
        # close to 1 never multiplies an inexact difference that should nearly cancel.
        ref = ints[i][int(np.argmax(np.where(live, self.fp.Z[h, i], -np.inf)))] if live.any() else 0
        return [flint.arb(n - ref) for n in ints[i]], flint.arb(2) ** base

    def _dP_exact(self, h: int, i: int) -> list[Fraction]:
        ints, base = self._dP_head(h)
        return [_fraction(int(n), base) for n in ints[i]]

    def _scaled(self, R: Fraction) -> tuple[str, Any]:
        """The exact value s R: rational, or s irrational times a rational."""
        sc = self.pb.scale
        if sc.rational is not None:
            return "rational", sc.rational * R
        return ("rational", Fraction(0)) if R == 0 else ("scaled", R)

    def exact_info(self, which: str, flat: int) -> tuple[str, Any]:
        """("rational", value), ("scaled", R) for s R, ("irrational", why) or ("unknown", why)."""
        key = (which, flat)
        if key not in self._exact:
            self._exact[key] = self._analyse(which, flat)
        return self._exact[key]

    def _analyse(self, which: str, flat: int) -> tuple[str, Any]:
        pb, fp = self.pb, self.fp
        b, r, c = (int(x) for x in np.unravel_index(flat, self.pb.flat_shape(which)))
        if which == "out":
            return self._analyse_out(b, r, c)
        heads = [int(h) for h in pb.copies(which)[b]]
        if which == "query" and len(heads) == 1:
            return self._analyse_row_grad_query(heads[0], r, c)
        # A sum over rows: exact only when every contributing row has rational weights.
        contributing = [(h, int(i)) for h in heads for i in self._contributing(which, h, r, c)]
        transcendental = sum(not self._rational_rows(h)[i] for h, i in contributing)
        if transcendental:
            return "unknown", (f"it sums terms from {len(contributing)} query rows, {transcendental} of "
                               "them with transcendental attention weights, and such a sum is found exact "
                               "only when every term is rational")
        R = Fraction(0)
        for h, i in contributing:
            n = int(fp.unmasked[h, i].sum())
            if not n:
                continue
            g = self.G[h, i]
            if which == "value":
                R += Fraction(float(g[c])) / n
                continue
            dP, D = self._dP_row(h, i)
            if which == "key":
                R += (dP[r] - D) / n * Fraction(float(fp.Qh[h, i, c]))
            else:
                live = np.flatnonzero(fp.unmasked[h, i]).tolist()
                R += sum(((dP[j] - D) * Fraction(float(fp.Kh[h, j, c])) for j in live), Fraction(0)) / n
        return ("rational", R) if which == "value" else self._scaled(R)

    def _dP_row(self, h: int, i: int) -> tuple[list[Fraction], Fraction]:
        """Row i's exact dP and its mean D over the live keys (D for rational weights 1/n)."""
        if (h, i) not in self._dP_rows:
            dP = self._dP_exact(h, i)
            live = np.flatnonzero(self.fp.unmasked[h, i]).tolist()
            D = sum((dP[j] for j in live), Fraction(0)) / max(len(live), 1)
            self._dP_rows[(h, i)] = (dP, D)
        return self._dP_rows[(h, i)]

    def _contributing(self, which: str, h: int, r: int, c: int) -> np.ndarray:
        """The query rows of head h whose term in element (r, c) of a gradient sum is not exactly zero."""
        fp = self.fp
        if which == "value":
            return np.flatnonzero(fp.unmasked[h, :, r] & (self.G[h, :, c] != 0))
        varies = self._dP_varies(h)  # a row whose dP is constant over its keys has dP - D = 0, so dS = 0
        if which == "key":
            return np.flatnonzero(fp.unmasked[h, :, r] & varies & (fp.Qh[h, :, c] != 0))
        live = fp.unmasked[h, r]
        return np.array([r] if varies[r] and fp.Kh[h, live, c].any() else [], dtype=np.int64)

    def _dP_varies(self, h: int) -> np.ndarray:
        """(L,) bool: row i's exact dP is not constant over its live keys.

        Decided from the first pass's enclosures where two of them are disjoint
        (nearly every row), exactly from the integers of dP otherwise.
        """
        if h not in self._varies:
            fp = self.fp
            live = fp.unmasked[h]
            with np.errstate(invalid="ignore", over="ignore"):
                dP, e_dP = dp_rows(*(a[h] for a in fp.dP_parts))
                lo = np.where(live, next_down(dP - e_dP), -np.inf)
                hi = np.where(live, next_up(dP + e_dP), np.inf)
                varies = np.max(lo, axis=-1, initial=-np.inf) > np.min(hi, axis=-1, initial=np.inf)
            for i in np.flatnonzero(~varies):
                ints = self._dP_head(h)[0][i]
                varies[i] = len({ints[j] for j in np.flatnonzero(live[i])}) > 1
            self._varies[h] = varies
        return self._varies[h]

    def _rational_rows(self, h: int) -> np.ndarray:
        """(L,) bool: every live logit of row i is exactly the same, so its weights are 1/n, rational.

        Rows with two disjoint logit enclosures from the first pass are not (by
        Lindemann-Weierstrass their weights are transcendental); the rest are
        checked exactly.
        """
        if h not in self._rational:
            fp = self.fp
            live = fp.unmasked[h]
            with np.errstate(invalid="ignore", over="ignore"):
                lo = np.where(live, next_down(fp.Z[h] - fp.ez[h]), -np.inf)
                hi = np.where(live, next_up(fp.Z[h] + fp.ez[h]), np.inf)
                differ = np.max(lo, axis=-1, initial=-np.inf) > np.min(hi, axis=-1, initial=np.inf)
            rational = ~differ
            for i in np.flatnonzero(rational):
                rational[i] = self._row_rational(h, int(i))
            self._rational[h] = rational
        return self._rational[h]

    def _groups(self, h: int, i: int) -> dict[Any, list[int]]:
        groups: dict[Any, list[int]] = defaultdict(list)
        for j, k in enumerate(self._logit_keys(h, i)):
            if k is not None:
                groups[k].append(j)
        return groups

    def _analyse_out(self, h: int, i: int, c: int) -> tuple[str, Any]:
        groups = self._groups(h, i)
        if not groups:
            return "rational", Fraction(0)
        V = self.fp.Vh[h]
        ratios = {sum((Fraction(float(V[j, c])) for j in js), Fraction(0)) / len(js) for js in groups.values()}
        if len(ratios) == 1:
            return "rational", ratios.pop()
        return "irrational", "its value is transcendental (Lindemann-Weierstrass)"

    def _analyse_row_grad_query(self, h: int, i: int, c: int) -> tuple[str, Any]:
        groups = self._groups(h, i)
        if not groups:
            return "rational", Fraction(0)
        dP = self._dP_exact(h, i)
        K = self.fp.Kh[h]
        info = []
        for key, js in groups.items():
            k = [Fraction(float(K[j, c])) for j in js]
            alpha = sum((dP[j] * kj for j, kj in zip(js, k)), Fraction(0))
            beta = sum((dP[j] for j in js), Fraction(0))
            info.append((key, len(js), alpha, beta, sum(k, Fraction(0))))
        num: dict[Any, Fraction] = defaultdict(Fraction)
        den: dict[Any, Fraction] = defaultdict(Fraction)
        for kg, ng, ag, bg, _ in info:
            for kh, nh, _, _, gh in info:
                t = kg + kh if not isinstance(kg, tuple) else (kg[0] + kh[0], kg[1] + kh[1])
                num[t] += ag * nh - bg * gh
                den[t] += ng * nh
        sc = self.pb.scale
        if sc.rational is None:
            if all(v == 0 for v in num.values()):
                return "rational", Fraction(0)
            return "irrational", "its value is irrational (Lindemann-Weierstrass)"
        t0 = next(iter(den))
        value = sc.rational * num[t0] / den[t0]
        if all(sc.rational * num[t] == value * den[t] for t in den):
            return "rational", value
        return "irrational", "its value is transcendental (Lindemann-Weierstrass)"

    # ------------------------------------------------------------------ the loop

    # ------------------------------------------------------------------ the work budget

    def _cost(self, which: str, flats: list[int], bits: int, split: bool) -> float:
        """The work of evaluating ``flats`` at ``bits`` bits, directly or split, in units of one 64-bit exp.

        A generous estimate from the shapes: the rows (or whole heads) the
        elements need, their exps and matrix products, and a few units per
        Fraction operation of the split.
        """
        pb = self.pb
        f = (bits / 64) ** 1.5
        b, r, _ = np.unravel_index(np.asarray(flats, dtype=np.int64), self.pb.flat_shape(which))
        # (Distinct rows and heads counted by np.unique: a float64 output asks for every element.)
        if which == "out":
            rows = np.unique(b * pb.L + r).size
            cost = rows * pb.S * (1 + pb.Ev / 32) * f
            return cost * _FRACTION + len(flats) * pb.S * _FRACTION * f if split else cost
        heads = pb.copies(which)[b]  # (n, copies)
        if which == "query":
            rows = np.unique(heads * pb.L + r[:, None]).size
            # Each head's exact dP = dO V^T (integers), once, and the rows' weights and dS.
            fresh = len(set(np.unique(heads).tolist()) - set(self._dP))
            cost = rows * pb.S * (2 + pb.E / 32) * f + fresh * pb.L * pb.S * max(pb.Ev, 1) / 16
            if split:
                cost += (rows * pb.S + len(flats) * heads.shape[1] * pb.S ** 2 / 2) * _FRACTION * f
            return cost
        count = dict(zip(*(a.tolist() for a in np.unique(heads, return_counts=True))))
        if split:
            return len(count) * pb.L * pb.S * _FRACTION * f + len(flats) * heads.shape[1] * pb.L * 4 * f * _FRACTION
        return sum(head_cost(pb, bits, n) for n in count.values())

    def _plan(self, which: str, flats: list[int], bits: int, split: bool) -> tuple[bool, float] | None:
        """(split, cost) of the cheapest affordable way to evaluate ``flats`` at ``bits``, or None.

        The split (R + eps) is preferred where it fits in what is left of the
        budget: it alone settles a value exactly at a boundary.  A direct ball
        is the fallback.
        """
        left = self.budget - self._spent
        if split:
            cost = self._cost(which, flats, bits, True)
            if cost <= left:
                return True, cost
        cost = self._cost(which, flats, bits, False)
        return (False, cost) if cost <= left else None

    def refine(self, which: str, flats: np.ndarray, fmt: Format, presorted: bool = False
               ) -> dict[int, Decision]:
        """Decide every flat index in ``flats``: {flat: (rounded, x_lo, x_hi)}; ``presorted``: the
        caller has already taken out the structural zeros.

        Raises ReferenceUnavailableError where an element is undecided at the
        precision cap, and ReferenceBudgetError where deciding it would take
        more work than ``budget`` allows (so that no call runs for hours).
        """
        # Every element here has been through a second pass (64-bit extended or double-double,
        # op._passes), which a 64-bit ball does not beat: start at twice that.
        start = 2 * START_PRECISION
        self._start = start
        flats = np.asarray(flats, dtype=np.int64)
        decided: dict[int, Decision] = {}
        if flats.size == 0:
            return decided
        if not presorted:
            zero = self.structural_zeros(which, flats)
            for f in flats[zero]:
                decided[int(f)] = (0.0, 0.0, 0.0)
            flats = flats[~zero]
        pending = [int(f) for f in flats]
        if not pending:
            return decided
        last: dict[int, flint.arb] = {}
        reached = [0, False]  # the precision evaluated last, and whether it is the last affordable one

        def describe(f: int) -> str:
            why = self._exact.get((which, f), ("unknown", ""))[1]
            text = f"{self.name(which)} at {self.index(which, f)}"
            ball = last.get(f)
            if ball is not None and ball.contains(0):
                text += " is zero to within the working precision, perhaps exactly zero by cancellation"
            elif ball is not None:
                text += f" lies on the rounding boundary {float(ball.mid())!r} to within the working precision"
            return text + (f"; {why}" if isinstance(why, str) and why else "")

        def evaluate(indices: list[int]) -> list[flint.arb]:
            bits = flint.ctx.prec
            balls: dict[int, flint.arb] = {}
            arb_needed = []
            for f in indices:
                info = self.exact_info(which, f) if bits > start else ("unknown", "")
                if info[0] == "rational":
                    balls[f] = _ball(info[1])
                elif info[0] == "scaled":
                    balls[f] = _ball(info[1]) * self.pb.scale.ball()
                else:
                    arb_needed.append(f)
            if arb_needed:
                # Past the first precision, as R + eps: a direct ball cannot resolve a tiny eps.
                plan = self._plan(which, arb_needed, bits, bits > start)
                if plan is None:
                    raise ReferenceBudgetError(self._over_budget(describe(arb_needed[0]), which, arb_needed,
                                                                 fmt, bits))
                split, cost = plan
                self._spent += cost
                balls.update(self._split_values(which, arb_needed) if split
                             else self._arb_values(which, arb_needed))
            last.update(balls)
            reached[0] = bits
            reached[1] = bits >= MAX_PRECISION or (
                bool(arb_needed) and self._plan(which, arb_needed, 2 * bits, True) is None)
            return [balls[f] for f in indices]

        def decide_all(items: list[Any], fmt: Format) -> list[Decision | None]:
            with precision(reached[0]):  # the balls' own: x - hi is then exact as often as can be
                out, left = _decide_many(items, fmt)
            for t in left:
                # At the last precision that will be tried, a ball proven to round to zero is +0.
                out[t] = decide_split(items[t], fmt, final=reached[1])
            return out

        decided.update(round_certified(evaluate, pending, fmt, describe, start=start, decide_all=decide_all))
        return decided

    def _over_budget(self, what: str, which: str, flats: list[int], fmt: Format, bits: int) -> str:
        need = self._cost(which, flats, bits, False)
        return (f"{what}: its rounding to {fmt.name} is still undecided at {bits // 2} bits of precision, and "
                f"the next step ({len(flats)} element(s) at {bits} bits) would take about {need:.3g} units of "
                f"work (one unit: about one 64-bit Arb exp), past what is left of the budget of "
                f"{self.budget:.3g} (spent {self._spent:.3g}); its exact value is probably exactly a rounding "
                "boundary, or extremely close to one. Pass a larger refine_budget to allow more work")

    def exact_value(self, which: str, flat: int, bits: int = 128) -> flint.arb:
        """A ball holding the exact value of one element (exact when it is a known dyadic rational)."""
        with precision(bits):
            info = self.exact_info(which, flat)
            if info[0] == "rational":
                return _ball(info[1])
            if info[0] == "scaled":
                return _ball(info[1]) * self.pb.scale.ball()
            if self._cost(which, [flat], bits, True) <= _REPORT_WORK:
                return self._split_values(which, [flat])[flat].ball
            return self._arb_values(which, [flat])[flat]
