"""An independent oracle for scaled_dot_product_attention, forward and backward.

It shares no code with exactref: it works from the mathematical definition
with mpmath at 320 bits, and with Fractions for every row whose attention
weights are rational (all the row's unmasked logits equal, so each weight
is 1/n), so that exactly rational results (ties, exact zeros) round
exactly.  Rounding to a format is written out here with Python integers.
"""

from __future__ import annotations

import math
from fractions import Fraction

import mpmath
import numpy as np

PREC = 320
# Formats as (precision p, emin, emax).
FORMATS = {"float64": (53, -1022, 1023), "float32": (24, -126, 127), "float16": (11, -14, 15),
           "bfloat16": (8, -126, 127)}


def _to_fraction(x) -> Fraction:
    if isinstance(x, Fraction):
        return x
    if isinstance(x, mpmath.mpf):
        sign, man, exp, _ = x._mpf_
        man, exp = (-1) ** sign * int(man), int(exp)
        return Fraction(man * 2 ** exp) if exp >= 0 else Fraction(man, 2 ** -exp)
    return Fraction(x)


def round_to(x, fmt: str) -> float:
    """Round an exact Fraction, or an mpf taken as exact, to nearest-even in ``fmt``."""
    p, emin, emax = FORMATS[fmt]
    if isinstance(x, mpmath.mpf) and x != 0:
        # Far outside the format (exp(-2**1000), say) the Fraction would not fit in memory.
        e = int(x._mpf_[2]) + int(x._mpf_[3])  # |x| < 2**e
        if e < emin - p - 1:
            return math.copysign(0.0, float(mpmath.sign(x)))
        if e > emax + 2:
            return float(mpmath.sign(x)) * math.inf
    q = _to_fraction(x)
    if q == 0:
        return 0.0
    sign = -1.0 if q < 0 else 1.0
    q = abs(q)
    e = q.numerator.bit_length() - q.denominator.bit_length()
    # Find e with 2**e <= q < 2**(e+1).
    if Fraction(2) ** e > q:
        e -= 1
    elif Fraction(2) ** (e + 1) <= q:
        e += 1
    quantum = max(e, emin) - (p - 1)
    scaled = q / Fraction(2) ** quantum
    n, rest = divmod(scaled.numerator, scaled.denominator)
    twice = 2 * rest
    if twice > scaled.denominator or (twice == scaled.denominator and n % 2 == 1):
        n += 1
    largest = (2 ** p - 1) * Fraction(2) ** (emax - p + 1)
    value = n * Fraction(2) ** quantum
    if value > largest:
        return sign * math.inf
    return sign * float(value)


def _num(x: float):
    return Fraction(float(x))


class Oracle:
    """Forward and gradients of one attention call, elementwise, from the definition."""

    def __init__(self, q, k, v, mask=None, is_causal=False, scale=None, enable_gqa=False,
                 bottom_right=False, prec=PREC) -> None:
        # A value within 2**-prec of a rounding boundary needs more: pass a larger prec.
        mpmath.mp.prec = prec
        q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
        self.shapes = (q.shape, k.shape, v.shape)
        L, E = q.shape[-2:]
        S = k.shape[-2]
        if enable_gqa and q.ndim >= 3 and k.shape[-3] != q.shape[-3]:
            rep = q.shape[-3] // k.shape[-3]
            k_idx = np.repeat(np.arange(k.shape[-3]), rep)
        else:
            rep, k_idx = 1, None
        # Index arrays of every operand's own elements, broadcast to the common batch.
        def ids(a, gqa):
            n = np.arange(int(np.prod(a.shape[:-2], dtype=np.int64))).reshape(a.shape[:-2])
            if gqa and k_idx is not None:
                n = np.take(n, k_idx, axis=-1)
            return n
        qn, kn, vn = ids(q, False), ids(k, True), ids(v, True)
        qn, kn, vn = np.broadcast_arrays(qn, kn, vn)
        self.batch = qn.shape
        self.qn, self.kn, self.vn = qn.reshape(-1), kn.reshape(-1), vn.reshape(-1)
        self.q = q.reshape((-1, L, E))
        self.k = k.reshape((-1, S, E))
        self.v = v.reshape((-1, S, v.shape[-1]))
        self.L, self.S, self.E, self.Ev = L, S, E, v.shape[-1]
        H = len(self.qn)
        if scale is None:
            r = math.isqrt(E)
            self.scale = Fraction(1, r) if r * r == E else mpmath.mpf(1) / mpmath.sqrt(E)
        else:
            self.scale = Fraction(float(scale))
        allowed = np.ones((H, L, S), dtype=bool)
        add = np.zeros((H, L, S))
        if mask is not None:
            m = np.broadcast_to(np.asarray(mask), self.batch + (L, S)).reshape(H, L, S)
            if m.dtype == bool:
                allowed = m.copy()
            else:
                allowed = m != -np.inf
                add = np.where(allowed, m.astype(np.float64), 0.0)
        if is_causal:
            shift = S - L if bottom_right else 0
            for i in range(L):
                for j in range(S):
                    if j > i + shift:
                        allowed[:, i, j] = False
        self.allowed, self.add = allowed, add
        self._rows = {}

    def _row(self, h, i):
        """(P as a list, rational flag, dP list, D) for row i of head h, without the backward parts."""
        if (h, i) in self._rows:
            return self._rows[(h, i)]
        qv, kv = self.q[self.qn[h], i], self.k[self.kn[h]]
        logits = {}
        for j in range(self.S):
            if not self.allowed[h, i, j]:
                continue
            d = sum((_num(qv[c]) * _num(kv[j, c]) for c in range(self.E)), Fraction(0))
            if isinstance(self.scale, Fraction):
                logits[j] = self.scale * d + _num(self.add[h, i, j])
            else:
                logits[j] = self.scale * mpmath.mpf(d.numerator) / d.denominator + mpmath.mpf(self.add[h, i, j])
        vals = list(logits.values())
        rational = all(x == vals[0] for x in vals)
        P = [Fraction(0)] * self.S
        if logits and rational:
            for j in logits:
                P[j] = Fraction(1, len(logits))
        elif logits:
            top = max(mpmath.mpf(x.numerator) / x.denominator if isinstance(x, Fraction) else x for x in vals)
            w = {j: mpmath.exp((mpmath.mpf(x.numerator) / x.denominator if isinstance(x, Fraction) else x) - top)
                 for j, x in logits.items()}
            W = mpmath.fsum(w.values())
            for j, wj in w.items():
                P[j] = wj / W
        self._rows[(h, i)] = (P, rational or not logits)
        return self._rows[(h, i)]

    def out(self):
        H = len(self.qn)
        result = np.zeros((H, self.L, self.Ev), dtype=object)
        for h in range(H):
            vv = self.v[self.vn[h]]
            for i in range(self.L):
                P, _ = self._row(h, i)
                for c in range(self.Ev):
                    result[h, i, c] = _dot(P, [_num(vv[j, c]) for j in range(self.S)])
        return result.reshape(self.batch + (self.L, self.Ev))

    def grads(self, grad):
        H = len(self.qn)
        G = np.broadcast_to(np.asarray(grad, dtype=np.float64), self.batch + (self.L, self.Ev)).reshape(
            H, self.L, self.Ev)
        gq = np.zeros(self.q.shape, dtype=object)
        gk = np.zeros(self.k.shape, dtype=object)
        gv = np.zeros(self.v.shape, dtype=object)
        gq[...] = Fraction(0)
        gk[...] = Fraction(0)
        gv[...] = Fraction(0)
        s = self.scale
        # Each gradient's sum of |terms|, for telling the oracle's own noise from a value.
        mq, mk, mv = (np.zeros(a.shape) for a in (self.q, self.k, self.v))
        sabs = float(abs(_mpf(s))) if not isinstance(s, Fraction) else float(abs(s))
        # Over the whole float64 range these magnitudes overflow to inf, which only widens the noise test.
        with np.errstate(over="ignore", invalid="ignore"):
            for h in range(H):
                Pf = np.array([[float(abs(_mpf(x))) for x in self._row(h, i)[0]] for i in range(self.L)])
                vv = np.abs(self.v[self.vn[h]])
                g_abs = np.abs(G[h])
                dP_abs = g_abs @ vv.T
                dS_abs = Pf * (dP_abs + (Pf * dP_abs).sum(-1, keepdims=True))
                mq[self.qn[h]] += sabs * dS_abs @ np.abs(self.k[self.kn[h]])
                mk[self.kn[h]] += sabs * dS_abs.T @ np.abs(self.q[self.qn[h]])
                mv[self.vn[h]] += Pf.T @ g_abs
        self.magnitudes = {"grad_query": mq.reshape(self.shapes[0]), "grad_key": mk.reshape(self.shapes[1]),
                           "grad_value": mv.reshape(self.shapes[2])}
        for h in range(H):
            qv, kv, vv = self.q[self.qn[h]], self.k[self.kn[h]], self.v[self.vn[h]]
            for i in range(self.L):
                P, _ = self._row(h, i)
                g = [_num(x) for x in G[h, i]]
                dP = [sum((g[c] * _num(vv[j, c]) for c in range(self.Ev)), Fraction(0)) for j in range(self.S)]
                # dP_j - D = sum_k P_k (dP_j - dP_k): the differences are exact, so nothing
                # cancels catastrophically when one weight is close to 1.
                dS = [_mul(P[j], _dot(P, [dP[j] - x for x in dP])) for j in range(self.S)]
                for c in range(self.E):
                    gq[self.qn[h], i, c] = _add(gq[self.qn[h], i, c],
                                                _mul(s, _dot(dS, [_num(kv[j, c]) for j in range(self.S)])))
                for j in range(self.S):
                    for c in range(self.E):
                        gk[self.kn[h], j, c] = _add(gk[self.kn[h], j, c], _mul(s, _mul(dS[j], _num(qv[i, c]))))
                    for c in range(self.Ev):
                        gv[self.vn[h], j, c] = _add(gv[self.vn[h], j, c], _mul(P[j], g[c]))
        qs, ks, vs = self.shapes
        return {"grad_query": gq.reshape(qs), "grad_key": gk.reshape(ks), "grad_value": gv.reshape(vs)}


def _mpf(x):
    return mpmath.mpf(x.numerator) / x.denominator if isinstance(x, Fraction) else x


def _add(a, b):
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return a + b
    return _mpf(a) + _mpf(b)


def _sub(a, b):
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return a - b
    return _mpf(a) - _mpf(b)


def _mul(a, b):
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        return a * b
    if (isinstance(a, Fraction) and a == 0) or (isinstance(b, Fraction) and b == 0):
        return Fraction(0)
    return _mpf(a) * _mpf(b)


def _dot(xs, ys):
    total = Fraction(0)
    for x, y in zip(xs, ys):
        total = _add(total, _mul(x, y))
    return total


def is_near_boundary(x, fmt: str, magnitude: float = 0.0, bits: int = 250) -> bool:
    """Whether an mpf value lies within 2**-bits of a rounding boundary or of zero, relative to ``magnitude``
    (the sum of |terms| it came from) or to itself.

    Such a value may be exactly a boundary that the oracle's 320 bits cannot
    tell from a point beside it; exactref must raise ReferenceUnavailableError
    or round it as the oracle does.
    """
    if isinstance(x, Fraction):
        return False
    if abs(x) <= mpmath.mpf(magnitude) * mpmath.mpf(2) ** -bits:
        return True
    p, emin, _ = FORMATS[fmt]
    e = int(mpmath.floor(mpmath.log(abs(x), 2)))
    quantum = mpmath.mpf(2) ** (max(e, emin) - p)  # half an ulp: boundaries are odd multiples
    k = mpmath.nint(x / quantum)
    return abs(x - k * quantum) <= max(abs(x), mpmath.mpf(magnitude)) * mpmath.mpf(2) ** -bits
