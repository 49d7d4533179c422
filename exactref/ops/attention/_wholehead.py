"""grad_key and grad_value of one head in Arb, as matrix products: what an element summed over rows needs.

An element of grad_key or grad_value sums over every query row of its head,
and each row's weights need that row's whole softmax, so in Arb its cost is
L * S exps whatever is done.  Done element by element in Python, as the
row-wise refinement does, that is several Python operations per weight; here
the only per-weight Python operation is the exp itself:

* the logits are the product Q K^T of the exact inputs as ``arb_mat``, scaled
  by s;
* the unnormalised weights w_ij = exp(x_ij) need no shift in Arb, whose
  exponents do not overflow, so P_ij = w_ij / W_i with W = w 1;
* D_i = rowsum(P_i * dP_i) = dO_i . O_i with O = P V, one product;
* then grad_value[j, c] = sum_i w_ij dO_ic / W_i and grad_key[j, c] =
  s sum_i w_ij (dP_ij - D_i) q_ic / W_i take L operations per element, with
  column j of dP = dO V^T exact.
"""

from __future__ import annotations

from typing import Any

import flint
import numpy as np

from ._first import FirstPass
from ._problem import Problem

__all__ = ["BULK", "WholeHead", "head_cost"]


def int_matrix(a: np.ndarray) -> tuple[flint.fmpz_mat, int]:
    """An integer matrix M and an exponent e with a == M * 2**e exactly (a finite, float64)."""
    mant, ex = np.frexp(a)
    m = np.ldexp(mant, 53).astype(np.int64)
    ex = ex.astype(np.int64) - 53
    nonzero = m != 0
    base = int(ex[nonzero].min()) if nonzero.any() else 0
    shifts = np.where(nonzero, ex - base, 0).reshape(-1).tolist()
    entries = [int(v) << k for v, k in zip(m.reshape(-1).tolist(), shifts)]
    return flint.fmpz_mat(a.shape[0], a.shape[1], entries), base


def _arb_mat(a: np.ndarray) -> flint.arb_mat:
    rows, cols = a.shape
    return flint.arb_mat(rows, cols, a.reshape(-1).tolist())


def _pow2(e: int) -> flint.arb:
    return flint.arb(2) ** e


#: A head with more elements asked for than this computes its whole gradient (see WholeHead.full).
BULK = 8


def head_cost(pb: Problem, bits: int, elements: int) -> float:
    """The work of one :class:`WholeHead` at ``bits`` bits giving ``elements`` elements of one gradient,
    in units of one exp at 64 bits."""
    f = (bits / 64) ** 1.5
    base = pb.L * pb.S * (1.0 + (pb.E + pb.Ev) / 256) * f  # the exps; the products run in C
    if elements > BULK:
        return base + pb.L * (pb.S * 3 + pb.E + pb.Ev) * f
    return base + elements * pb.L * (4 + pb.Ev / 8) * f


class WholeHead:
    """The weights of every row of head ``h``, and the row quantities its column sums need, at the current precision."""

    def __init__(self, pb: Problem, fp: FirstPass, G: np.ndarray | None, h: int, head: Any = None) -> None:
        """``head``: the row-wise refinement's quantities of head h at this precision, if any
        (``_certified._Head``): rows of dS it has computed are reused."""
        L, S, E = pb.L, pb.S, pb.E
        self.pb, self.fp, self.G, self.h, self.head = pb, fp, G, h, head
        self.s = pb.scale.ball()
        zero = flint.arb(0)
        self._D: list[flint.arb] | None = None
        self._full: dict[str, list[flint.arb]] = {}
        known = fp.arb_weights.get((h, flint.ctx.prec), {})
        self.normalised = bool(L and S and len(known) == L)
        if self.normalised:
            # Every row's normalised weights are known already (a float64 output refines them all):
            # they stand for w, with W = 1 (0 for a row that attends to nothing).
            self.w = [x for i in range(L) for x in known[i]]
            self.wm = flint.arb_mat(L, S, self.w)
            live = fp.unmasked[h].any(axis=-1).tolist()
            self.inv_W = [flint.arb(1) if a else zero for a in live]
            return
        if S and E and L:
            # An Arb product of the exact float inputs: faster than an exact integer one, whose entries
            # span the inputs' exponents, and as tight as the working precision.
            logits = ((_arb_mat(fp.Qh[h]) * _arb_mat(fp.Kh[h]).transpose()) * self.s).entries()
        else:
            logits = [zero] * (L * S)
        live = fp.unmasked[h].reshape(-1).tolist()
        if pb.additive is None:
            w = [x.exp() if u else zero for x, u in zip(logits, live)]
        else:
            add = pb.additive[h].reshape(-1).tolist()
            w = [(x + a).exp() if u else zero for x, a, u in zip(logits, add, live)]
        self.w = w  # row-major (L, S)
        self.wm = flint.arb_mat(L, S, w) if L and S else None
        if self.wm is not None:
            W = (self.wm * flint.arb_mat(S, 1, [1] * S)).entries()
        else:
            W = [zero] * L
        # A row that attends to no key has P = 0: its 1/W is taken as 0.
        self.inv_W = [zero if x.is_zero() else 1 / x for x in W]

    def D(self) -> list[flint.arb]:
        """D_i = sum_j P_ij dP_ij = dO_i . O_i, O = P V."""
        if self._D is None:
            pb, G = self.pb, self.G
            L, Ev = pb.L, pb.Ev
            if self.wm is None or Ev == 0:
                self._D = [flint.arb(0)] * L
            else:
                O = (self.wm * _arb_mat(self.fp.Vh[self.h])).entries()
                g = G[self.h].reshape(-1).tolist()
                self._D = [sum((O[i * Ev + c] * g[i * Ev + c] for c in range(Ev) if g[i * Ev + c]), flint.arb(0))
                           * self.inv_W[i] for i in range(L)]
        return self._D

    def value(self, j: int, c: int) -> flint.arb:
        """grad_value[j, c] of this head: sum_i P_ij dO_ic."""
        S, g = self.pb.S, self.G[self.h][:, c]
        total = flint.arb(0)
        for i in np.flatnonzero(g).tolist():
            total += self.w[i * S + j] * (float(g[i]) * self.inv_W[i])
        return total

    def key(self, j: int, c: int) -> flint.arb:
        """grad_key[j, c] of this head: s sum_i dS_ij q_ic, dS_ij = P_ij (dP_ij - D_i)."""
        pb, h = self.pb, self.h
        S = pb.S
        q = self.fp.Qh[h][:, c]
        rows = np.flatnonzero((q != 0) & self.fp.unmasked[h][:, j])
        if not rows.size:
            return flint.arb(0)
        D = self.D()
        # Column j of dP = dO V^T, exactly: dO's rows against v_j as integers.
        Gi, eg = int_matrix(self.G[h][rows])
        vj, ev = int_matrix(self.fp.Vh[h][j:j + 1])
        dPj = (Gi * vj.transpose()).entries()
        scale = _pow2(eg + ev)
        total = flint.arb(0)
        for r, i in enumerate(rows.tolist()):
            t = self.w[i * S + j] * (dPj[r] * scale - D[i])
            total += t * (float(q[i]) * self.inv_W[i])
        return self.s * total

    def element(self, which: str, j: int, c: int) -> Any:
        """grad_key or grad_value [j, c] of this head, from column j alone (for a few elements of the
        head: many read :meth:`full`)."""
        return self.key(j, c) if which == "key" else self.value(j, c)

    def full(self, which: str) -> list[flint.arb]:
        """The head's whole grad_key or grad_value, row-major (S, E or Ev), as matrix products.

        grad_value = w^T (dO / W); grad_key = s (dS^T Q) with dS = w * (dP - D) / W,
        one Python product per weight (dP = dO V^T in Arb).
        """
        if which not in self._full:
            pb, h = self.pb, self.h
            L, S = pb.L, pb.S
            cols = pb.E if which == "key" else pb.Ev
            if self.wm is None or cols == 0:
                self._full[which] = [flint.arb(0)] * (S * cols)
                return self._full[which]
            g = self.G[h]
            if which == "value":
                if self.normalised:
                    scaled = g.reshape(-1).tolist()  # (1/W is 1, or 0 on a row whose weights are all 0)
                else:
                    scaled = [self.inv_W[i] * float(x) for i in range(L) for x in g[i].tolist()]
                self._full[which] = (self.wm.transpose() * flint.arb_mat(L, cols, scaled)).entries()
            else:
                if self.head is not None and len(self.head.dS_rows) == L:
                    # The row-wise refinement has every row of dS (grad_query of a float64 output).
                    dS = [x for i in range(L) for x in self.head.dS_rows[i]]
                else:
                    D = self.D()
                    dP = (_arb_mat(g) * _arb_mat(self.fp.Vh[h]).transpose()).entries() if pb.Ev else [0] * (L * S)
                    dS = [x if x.is_zero() else x * (d - D[i]) * self.inv_W[i]
                          for i in range(L) for x, d in zip(self.w[i * S:(i + 1) * S], dP[i * S:(i + 1) * S])]
                prod = flint.arb_mat(L, S, dS).transpose() * _arb_mat(self.fp.Qh[h])
                self._full[which] = [self.s * x for x in prod.entries()]
        return self._full[which]
