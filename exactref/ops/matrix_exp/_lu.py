"""|L||U| of the kernel's LU with partial pivoting of Q, enclosed by running the factorization on balls.

Theorem 9.4 of Higham's *Accuracy and Stability* bounds the backward error
of the LU solve by gamma_3n |L||U|, L and U the *computed* factors, which
the a priori growth bound 2^(n-1) makes loose.  Here the factorization is
run on Arb balls: Q's entries widened by the bound on |Q_computed - Q|, and
each entry of the k-th step widened by gamma_(k+1) (|q| + sum |l||u|), the
error of any order of its k products and subtractions (blocked, recursive
or right-looking), and each multiplier by the error of its division.  When
every pivot is decided (the candidate the kernel picks is larger than every
other one for all values in the balls), the kernel's factors lie in the
balls, and |L||U| is bounded by theirs.  Otherwise None: the caller falls
back to the growth bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import flint
import numpy as np

from ...engine.fast import gamma
from ...rounding import next_down, next_up

__all__ = ["lu_magnitudes"]


def _hi(x: Any) -> float:
    v = float(x.mid()) + float(x.rad())
    return float("inf") if math.isnan(v) else float(next_up(next_up(np.float64(v))))


def _lo(x: Any) -> float:
    v = float(x.mid()) - float(x.rad())
    return 0.0 if math.isnan(v) else max(0.0, float(next_down(next_down(np.float64(v)))))


class _Balls:
    def __init__(self, complex_: bool) -> None:
        self.complex_ = complex_

    def widen(self, x: Any, r: float) -> Any:
        if self.complex_:
            return x + flint.acb(flint.arb(0, r), flint.arb(0, r))
        return x + flint.arb(0, r)

    def mag(self, x: Any) -> Any:
        """What LAPACK's i?amax compares: |x|, or |re| + |im| for complex."""
        return abs(x.real) + abs(x.imag) if self.complex_ else abs(x)


@dataclass
class _State:
    """The factorization so far: Q's widened balls, the row order, and L's and U's balls and magnitudes."""

    Qb: list[list[Any]]
    absQ: np.ndarray
    balls: _Balls
    rows: list[int]
    L: list[list[Any]] = field(default_factory=list)
    U: list[list[Any]] = field(default_factory=list)
    absL: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))
    absU: np.ndarray = field(default_factory=lambda: np.zeros((0, 0)))

    def entry(self, pos: int, j: int, k: int, g: float) -> Any:
        """The computed entry at position pos, column j, after k elimination steps, in any order."""
        v, t = self.Qb[self.rows[pos]][j], self.absQ[self.rows[pos], j]
        for kk in range(k):
            v = v - self.L[pos][kk] * self.U[kk][j]
            t += self.absL[pos, kk] * self.absU[kk, j]
        return self.balls.widen(v, g * t) if k else v


def lu_magnitudes(Q: Any, dQ: np.ndarray, u_op: float, complex_: bool) -> np.ndarray | None:
    """An upper bound on P^T |L||U| (in Q's row order) for the kernel's LU of Q_computed, or None.

    ``Q`` is an arb_mat or acb_mat holding Q, ``dQ >= |Q_computed - Q|``, and
    ``u_op`` bounds the relative error of one arithmetic operation.
    """
    n = dQ.shape[0]
    b = _Balls(complex_)
    fudge = 1 + (4 * n + 16) * 2.0 ** -52
    Qb = [[b.widen(Q[i, j], float(dQ[i, j])) for j in range(n)] for i in range(n)]
    absQ = np.array([[_hi(abs(Qb[i][j])) for j in range(n)] for i in range(n)]).reshape(n, n)
    st = _State(Qb, absQ, b, list(range(n)), [[None] * n for _ in range(n)], [[None] * n for _ in range(n)],
                np.zeros((n, n)), np.zeros((n, n)))
    g_div = gamma(2, u_op)  # a reciprocal and a product, or one division
    for k in range(n):
        g = gamma(k + 1, u_op) * fudge
        col = [st.entry(pos, k, k, g) for pos in range(k, n)]
        mags = [b.mag(c) for c in col]
        p = max(range(len(col)), key=lambda i: _hi(mags[i]))
        low = _lo(mags[p])
        if not low > 0 or any(_hi(mags[i]) >= low for i in range(len(col)) if i != p):
            return None
        for seq in (st.rows, st.L):
            seq[k], seq[k + p] = seq[k + p], seq[k]
        st.absL[[k, k + p]] = st.absL[[k + p, k]]
        col[0], col[p] = col[p], col[0]
        pivot = col[0]
        st.U[k][k] = pivot
        st.absU[k, k] = _hi(abs(pivot))
        for j in range(k + 1, n):
            st.U[k][j] = st.entry(k, j, k, g)
            st.absU[k, j] = _hi(abs(st.U[k][j]))
        for pos in range(k + 1, n):
            lv = col[pos - k] / pivot
            st.L[pos][k] = lv = b.widen(lv, g_div * _hi(abs(lv)))
            st.absL[pos, k] = _hi(abs(lv))
    G_pos = (st.absL + np.eye(n)) @ st.absU * fudge
    G = np.empty_like(G_pos)
    G[st.rows] = G_pos
    return G
