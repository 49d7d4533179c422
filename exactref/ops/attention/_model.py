"""Attention's tolerance models: how far a correct kernel of an algorithm class may be from the exact value.

The derivation is in docs/attention.md ("How the tolerance is derived");
the names here follow it.  Every exact quantity a bound needs (a weight P,
|dP - D|, ...) is replaced by an upper bound from the first pass, so the
tolerance is an upper bound on the error of every kernel in the class, not
an estimate.  Arithmetic is in the accumulation format ``acc`` (float32 for
float16, bfloat16 and float32 inputs, float64 for float64), with unit
roundoff u:

1. the logits: every implementation computes x~_ij with
   |x~_ij - x_ij| <= delta_ij = gamma_{E+4} |s| sum_c |q_ic k_jc|
   + 2u (|x_ij| + |m_ij|) + 2u (|M_i| + |x_ij - M_i| + 2 ln S + 1) + underflow,
   the last term paying for the shift by the row maximum, or by a stored
   logsumexp, or by exp2's log2(e) prescaling;
2. the weights: P~_ij = P_ij (1 + rho_ij) with
   1 + rho_ij <= exp(delta_ij + r_i) F / (1 - h_i),
   h_i = sum_j P_ij (exp(delta_ij) - 1), F = (1 + k u) / (1 - k u) /
   ((1 - gamma_{S + nb}) (1 - u)**2), k the exp's error in units of u, nb
   the number of online-softmax blocks and r_i their rescalings;
3. the products with the weights (P V, P^T dO) and with dS (dS K, dS^T Q):
   each term off by its factor's relative error, plus gamma_n of the sum of
   |terms| for n-term sums in any order, plus the rounding of P or dS to a
   half input's format where the class does that;
4. a pre-scaled operand (``prescaled_operands_in_input_format``): a kernel
   that multiplies K (or Q) by a constant c (s, or s / ln 2 for exp2) and
   rounds the product to a half input's format before q . k' replaces each
   k_jc by k_jc c (1 + eps) + a, |eps| <= u_in, |a| <= eta_in / 2 (the
   rounding of c to float32 and of the float32 product are in gamma_{E+4}).
   So delta_ij gains (1 + gamma_{E+4}) u_in |s| sum_c |q_ic k_jc| + eta_in
   (sum_c |q_ic| + sum_c |k_jc|), whether K or Q is the operand; where the
   kernel also multiplies dS by that operand, each term of grad_query and
   grad_key gains u_in of its size and eta_in |dS|.  |k c| past the half
   format's range may overflow: NaN and inf are accepted in those rows;
5. dS rounded to a half format (``ds_in_input_format``) overflows where
   |dS~| reaches the format's largest finite value: inf, and NaN after
   inf * 0 or inf - inf, in every element of grad_query's row i and
   grad_key's row j that such a dS_ij feeds.  Where the bound on the
   kernel's |dS~| (the model's |dS| + e_S, or the cap's, the smaller) can
   reach it, inf and NaN are accepted; the finite tolerance is kept, since
   a dS that does not overflow leaves the bounds above as they are.
6. the math path's scaled operands: PyTorch's math path multiplies Q and K
   by sqrt(s) in acc before the logits' product, and in its backward
   grad_query = sqrt(s) dS~ (K sqrt(s))~ (grad_key likewise with Q).  The
   relative errors of those roundings are in gamma_{E+4} and the depth's
   six, but an element that underflows is off by up to eta absolutely,
   times |dS~|, which may be huge: each element of grad_query gains
   (1 + gamma_depth) sqrt(s) eta sum_j |dS~_ij| (sum_i for grad_key), with
   |dS~| bounded by |dS| + e_S, or by the kernel bound of the caps where
   that is not finite.  The term holds for the caps too, so it is added
   after them.  Every class gets it (negligible unless |dS| is huge); in
   the forward, delta's eta term pays for the same underflows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..._parallel import for_each_slice
from ..._pool import empty
from ...engine.fast import _UP_ABS, _UP_REL, gamma, up
from ...formats import FLOAT32, Format
from ._caps import backward_cap, cap_cannot_bind, ds_kernel_bound, forward_cap
from ._first import (
    _BLOCK,
    TINY,
    U,
    FirstPass,
    _cat_cols,
    _cat_rows_t,
    by_rows,
    dp_rows,
    expm1_up,
    matmul_up,
    t_rows,
)
from ._factors import factor
from ._loops import ds_bound_rows, ds_sums, rho_rows

__all__ = ["AttentionTolerance", "backward_tolerance", "forward_tolerance"]

# Every tolerance is multiplied by this, paying for the float64 rounding of
# the bound's own computation and the second-order terms left out above.
_SLACK = 1.0 + 2.0 ** -20


@dataclass(frozen=True)
class AttentionTolerance:
    """The algorithm class one direction (forward or backward) of attention is judged under.

    exp_error
        Relative error of the exp the kernel uses, in units of the
        accumulation format's unit roundoff.  16 covers Sleef's expf (1
        ulp), PyTorch's ``exp_u20`` (8.0 u measured over every float32 in
        [-87.34, 0]) and CUDA's ``ex2.approx``.
    kv_block
        Keys per block of an online softmax, whose running maximum rescales
        the partial sums (None: one block per row).  Smaller blocks mean more
        rescalings, so a class with block b covers kernels with blocks >= b.
    weights_in_input_format
        For float16 and bfloat16 inputs, the weights are rounded to the input
        format before they multiply V (forward) or dO (grad_value).
    ds_in_input_format
        For float16 and bfloat16 inputs, dS is rounded to the input format
        before it multiplies K (grad_query) or Q (grad_key).
    grad_query_block, grad_key_block
        The gradients are accumulated over blocks of keys (grad_query) or of
        query rows (grad_key, grad_value), adding one rounding per block.
    blocks_in_output_format
        Those running sums are stored in the output format between blocks
        (PyTorch's CPU fused backward for float16 and bfloat16).
    prescaled_operands_in_input_format
        For float16 and bfloat16 inputs, K or Q is multiplied by a constant
        (the scale, or scale / ln 2 for an exp2 softmax) and rounded to the
        input format before the logits' product, and in a backward before
        dS K and dS^T Q too (Triton's fused-attention tutorial pre-scales K
        so in its backward; older versions pre-scale Q in the forward).
        The logits gain u_in |s| sum_c |q_ic k_jc|, and those products
        u_in of each term.

    Rounding dS to a half format (``ds_in_input_format``) may overflow it:
    where |dS| can reach the format's largest finite value, inf and NaN are
    accepted in the elements of grad_query and grad_key it feeds.
    """

    name: str
    exp_error: float = 16.0
    kv_block: int | None = None
    weights_in_input_format: bool = False
    ds_in_input_format: bool = False
    grad_query_block: int | None = None
    grad_key_block: int | None = None
    blocks_in_output_format: bool = False
    prescaled_operands_in_input_format: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.exp_error, (int, float)) and 0 <= self.exp_error < 2 ** 20):
            raise ValueError(f"exp_error={self.exp_error!r} must be a number of unit roundoffs in [0, 2**20)")
        for name in ("kv_block", "grad_query_block", "grad_key_block"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name}={value!r} must be None or a positive int")

    def __str__(self) -> str:
        return self.name


def _blocks(n: int, block: int | None) -> int:
    return max(1, math.ceil(n / block)) if block else 1


def acc_format(fmt: Format) -> Format:
    """The format attention computes in: float32 for half inputs (PyTorch's opmath type)."""
    return fmt if fmt.p >= FLOAT32.p else FLOAT32


def _g(n: int, u: float) -> float:
    return float(gamma(max(n, 0), u))


class _Weights:
    """rho (relative error bound of the kernel's weights) and the shared bounds, for one model."""

    def __init__(self, fp: FirstPass, model: AttentionTolerance, fmt: Format) -> None:
        pb = fp.pb
        acc = acc_format(fmt)
        u = acc.unit_roundoff
        self.u, self.acc = u, acc
        self.eta = acc.min_normal  # an underflow, flushed to zero or not, costs at most this
        S, E = pb.S, pb.E
        k = model.exp_error
        nb = _blocks(S, model.kv_block)
        s = pb.scale.magnitude
        sigma = math.sqrt(s)
        H, L = fp.unmasked.shape[:2]
        n = H * L
        l1q = np.sum(np.abs(fp.Qh), axis=-1).reshape(n)
        l1k = np.sum(np.abs(fp.Kh), axis=-1)  # (H, S)
        heads = np.repeat(np.arange(H), L)
        flat = {name: getattr(fp, name).reshape(n, S) for name in ("unmasked", "Z", "ez", "A", "P_up")}
        add = None if pb.additive is None else pb.additive.reshape(n, S)
        # A pre-scaled operand rounded to a half input's format: u_in of each |q k| term, and an
        # absolute eta_in of each rounded element (item 4 of the module's docstring).
        self.prescaled = bool(model.prescaled_operands_in_input_format and fmt.p < acc.p)
        u_in, eta_in = (fmt.unit_roundoff, fmt.min_subnormal) if self.prescaled else (0.0, 0.0)
        self.u_in, self.eta_in = u_in, eta_in
        # delta and h depend on the model only through its pre-scaling: a forward's model and its
        # backward's (whose blocks differ) share them, and only r and rho are the model's own.
        shared = fp.weights_cache.get(("delta", self.prescaled))
        self.delta, self.h = shared if shared is not None else (empty((n, S), np.float64), np.empty(n))
        self.rho = empty((n, S), np.float64)
        self.r = np.zeros(n)
        self.nb = nb
        # The exp's and the sums' budget: rho's factor, and kept for the caps (_caps.py), which need
        # the logit errors and this budget themselves.
        self.F = (1 + k * u) / (1 - k * u) / ((1 - _g(S + nb, u)) * (1 - u) ** 2) * (1 + 2 ** -50)
        logit_coefs = (_g(E + 4, u) * s, sigma, s, E, up((1 + _g(E + 4, u)) * u_in * s), eta_in)
        step = max(1, _BLOCK // max(S, 1))
        M, rowmax = fp.M.reshape(n), fp.logit_rowmax.reshape(n)

        # The compiled loop's constants (exactref/ops/attention/_loops.py: the same values, bit for bit).
        loop_consts = (u, self.eta, *logit_coefs[:4], 2 * math.log(max(S, 1)), nb, k, self.F, _UP_REL, _UP_ABS)

        def block(sl: slice) -> None:
            f = {name: x[sl] for name, x in flat.items()}
            out = (self.delta[sl], self.h[sl], self.r[sl], self.rho[sl])
            if add is None and not self.prescaled and rho_rows(
                    f["unmasked"], f["Z"], f["ez"], f["A"], f["P_up"], M[sl], l1q[sl], l1k[heads[sl]], rowmax[sl],
                    shared is None, loop_consts, out):
                return
            if shared is None:
                self._logit_block(sl, f, None if add is None else add[sl], M[sl], l1q[sl], l1k[heads[sl]],
                                  logit_coefs)
            self._weight_block(sl, f["unmasked"], rowmax[sl], k)
        for_each_slice(block, n, step)  # independent blocks of rows, side by side
        if shared is None:
            fp.weights_cache[("delta", self.prescaled)] = (self.delta, self.h)
        self.delta, self.rho = self.delta.reshape(H, L, S), self.rho.reshape(H, L, S)
        self.r = self.r.reshape(H, L)
        m_abs = 0.0 if pb.additive is None else np.abs(pb.additive)
        # Where a logit, q sqrt(s) or k sqrt(s) may overflow acc, NaN and inf are acceptable.
        big = acc.max_finite / 2
        with np.errstate(over="ignore", invalid="ignore"):
            if pb.additive is None:
                # Each logit's test, (s A) 2 >= big, is monotone in A: the largest A of the row (NaN
                # passed over, as the test fails for it) decides it, in one pass instead of seven
                # over (H, L, S) values on one thread.
                row = s * np.fmax.reduce(fp.A, axis=-1, initial=0.0) * 2 >= big
            else:
                logit = s * fp.A * 2
                # A masked logit counts too: the math path adds -inf to it, and inf - inf is NaN.
                row = np.any(np.where(fp.unmasked, logit + m_abs >= big, logit >= big), axis=-1)
            qbig = sigma * np.max(np.abs(fp.Qh), axis=-1, initial=0.0) >= big
            kbig = np.any(sigma * np.max(np.abs(fp.Kh), axis=-1, initial=0.0) >= big, axis=-1)
        self.row_overflow = row | qbig | kbig[:, None]
        if self.prescaled:
            # k c or q c past the half format's range is inf there (c = s / ln 2 at most 1.45 s).
            lim = fmt.max_finite / 2
            c = 1.5 * s
            with np.errstate(over="ignore", invalid="ignore"):
                qpre = c * np.max(np.abs(fp.Qh), axis=-1, initial=0.0) >= lim
                kpre = np.any(c * np.max(np.abs(fp.Kh), axis=-1, initial=0.0) >= lim, axis=-1)
            self.row_overflow = self.row_overflow | qpre | kpre[:, None]


    def _logit_block(self, sl: slice, f: dict[str, np.ndarray], m: np.ndarray | None, M: np.ndarray,
                     l1q: np.ndarray, l1k: np.ndarray, coefs: tuple) -> None:
        """delta and h of the rows ``sl`` (flattened heads and rows); ``f`` holds the first pass's rows."""
        u, eta = self.u, self.eta
        g_logit, sigma, s, E, pre, eta_in = coefs
        S = f["Z"].shape[-1]
        unmasked = f["unmasked"]
        with np.errstate(over="ignore", invalid="ignore"):
            absZ = np.where(unmasked, np.abs(f["Z"]), 0.0)
            ezmax = np.max(f["ez"], axis=-1, keepdims=True) if S else np.zeros(f["ez"].shape[:-1] + (1,))
            x_up = absZ + f["ez"]
            M_up = np.abs(M)[..., None] + ezmax
            shift = np.abs(np.where(unmasked, f["Z"] - M[..., None], 0.0)) + f["ez"] + ezmax
            m_abs = 0.0 if m is None else np.abs(m)
            delta = (g_logit * f["A"] + 2 * u * (x_up + m_abs)
                     + 2 * u * (M_up + shift + 2 * math.log(max(S, 1)) + 1)
                     + eta * (2 * sigma * (1 + u) * (l1q[:, None] + l1k) + 4 * E) * (1 + s))
            if self.prescaled:  # (pre is up(0) > 0 otherwise)
                delta = delta + pre * f["A"] + eta_in * (l1q[:, None] + l1k)
            delta = up(np.where(unmasked, delta, 0.0))
            self.h[sl] = np.sum(f["P_up"] * expm1_up(delta), axis=-1)
        self.delta[sl] = delta

    def _weight_block(self, sl: slice, unmasked: np.ndarray, rowmax: np.ndarray, k: float) -> None:
        """r and rho of the rows ``sl``, from their delta and h (``k``: the exp's error in units of u)."""
        u, nb = self.u, self.nb
        delta, h = self.delta[sl], self.h[sl]
        with np.errstate(over="ignore", invalid="ignore"):
            r = (nb - 1) * (2 * (k + 2) * u + 4 * u * rowmax) if nb > 1 else np.zeros_like(h)
            rho = up((1 + expm1_up(delta + r[..., None])) * self.F / (1 - h[..., None]) - 1)
            rho = np.where((h < 0.5)[..., None] & np.isfinite(rho), rho, np.inf)
        self.r[sl] = r
        self.rho[sl] = np.where(unmasked, rho, 0.0)


def _weights(fp: FirstPass, model: AttentionTolerance, fmt: Format) -> _Weights:
    """The model's bounds on the weights, computed once per forward: no output gradient enters them."""
    wts = fp.weights_cache.get(model)
    if wts is None:
        wts = fp.weights_cache[model] = _Weights(fp, model, fmt)
    return wts


def forward_tolerance(fp: FirstPass, model: AttentionTolerance, fmt: Format
                      ) -> tuple[np.ndarray, np.ndarray, _Weights]:
    """E (H, L, Ev) for the output, where partial results may overflow, and the weights' bounds."""
    pb = fp.pb
    wts = _weights(fp, model, fmt)
    u, eta = wts.u, wts.eta
    S = pb.S
    half = fmt.p < wts.acc.p
    u_p = fmt.unit_roundoff if (model.weights_in_input_format and half) else 0.0
    eta_p = fmt.min_subnormal if (model.weights_in_input_format and half) else 0.0
    n = S + wts.nb + 1
    gn = _g(n, u)
    with np.errstate(over="ignore", invalid="ignore"):
        c = (1 + u_p) * (1 + gn) - 1
        # coef = P_up (rho + (1 + rho) c), formed a block of rows at a time by matmul_up.
        E = matmul_up(fp.P_up, fp.absV, of=factor("relative", c), more=(wts.rho,))
        E = E + ((eta_p + eta) * (1 + gn) * fp.colsumV)[:, None, :] + 2 * n * eta
        E = up(E * _SLACK)
        E = np.where(np.isfinite(E), E, np.inf)
        # Where the weights' relative bound fails (huge logits), the hull still bounds the output.
        E = np.fmin(E, forward_cap(fp, wts, u_p, eta_p))
        colbig = (S * np.max(fp.absV, axis=-2, initial=0.0)) >= wts.acc.max_finite / 2
    overflow = wts.row_overflow[..., None] | colbig[:, None, :]
    return E, overflow, wts


def _dS_bound_rows(B, dP_hi, dP_lo, dP_rad, D, e_D1, P_up, rho, unmasked, dS, e_dS, e_Db, consts):
    """e_S (the bound on a kernel's dS error) and |dS| + e_dS of some rows (see _backward_shared);
    dP and T, with their bounds, are made from the first pass's dP_parts, D and its bound e_D1."""
    # (The same values by one compiled loop where it applies: _loops.py.)
    fused = ds_bound_rows(B, dP_hi, dP_lo, dP_rad, D, e_D1, P_up, rho, unmasked, dS, e_dS, e_Db, consts,
                          U=U, TINY=TINY, slack=_SLACK, up_constants=(_UP_REL, _UP_ABS))
    if fused is not None:
        return fused
    u, eta, g_dP, dP_eta, gS, S_eta, u_o, eta_o, ds_rounded = consts
    dP, e_dP = dp_rows(dP_hi, dP_lo, dP_rad)
    T, e_T = t_rows(dP_hi, dP_lo, dP_rad, D, e_D1)
    with np.errstate(over="ignore", invalid="ignore"):
        e_dPm = g_dP * B + dP_eta
        dP_up = np.abs(dP) + e_dP
        e_Da = (np.sum(P_up * (rho * dP_up + (1 + rho) * e_dPm), axis=-1)
                + gS * np.sum(P_up * (1 + rho) * (dP_up + e_dPm), axis=-1) + S_eta
                # A weight that underflows is off by up to eta absolutely, whatever dP is.
                + eta * (1 + gS) * np.sum(np.where(unmasked, dP_up + e_dPm, 0.0), axis=-1))
        e_D = up(np.maximum(e_Da, e_Db) * _SLACK)[..., None]
        t_up = np.abs(T) + e_T
        grow = (1 + rho) * (1 + u) ** 2
        # The weight's own underflow (up to eta) meets dP - D, which may be huge.
        e_S = P_up * ((grow - 1) * t_up + grow * (e_dPm + e_D)) + eta * (1 + grow * (t_up + e_dPm + e_D))
        dS_up = np.abs(dS) + e_dS
        if ds_rounded:
            e_S = e_S + u_o * (dS_up + e_S) + eta_o
        e_S = up(np.where(unmasked, e_S, 0.0))
    return e_S, dS_up


def _backward_shared(fp: FirstPass, model: AttentionTolerance, fmt: Format, E_fwd: np.ndarray
                     ) -> tuple[_Weights, np.ndarray, np.ndarray, np.ndarray]:
    """The weights' bounds, the bound e_S on the kernel's dS error, |dS| + e_dS and the heads that may
    overflow: what the three gradients share, computed once per output gradient and model."""
    hit = fp.bwd_cache.get(model)
    if hit is not None and hit[0] is E_fwd:
        return hit[1]
    pb = fp.pb
    wts = _weights(fp, model, fmt)
    u, eta = wts.u, wts.eta
    half = fmt.p < wts.acc.p
    u_o, eta_o = fmt.unit_roundoff, fmt.min_subnormal
    S, Ev = pb.S, pb.Ev
    rho = wts.rho
    big = wts.acc.max_finite / 2
    with np.errstate(over="ignore", invalid="ignore"):
        o_up = np.abs(fp.O) + fp.rad_O
        o_err = E_fwd * (1 + u_o) + u_o * o_up + eta_o
        e_Db = (np.einsum("hlc,hlc->hl", fp.absG, o_err)
                + _g(Ev + 1, u) * np.einsum("hlc,hlc->hl", fp.absG, o_up + o_err) + Ev * eta)
        consts = (u, eta, _g(Ev + 1, u), 2 * Ev * eta, _g(S + wts.nb + 1, u), S * eta, u_o, eta_o,
                  bool(model.ds_in_input_format and half))
        e_S, dS_up = by_rows(_dS_bound_rows, pb.H, pb.L, fp.B, *fp.dP_parts, fp.D, fp.e_D, fp.P_up, rho,
                             fp.unmasked, fp.dS, fp.e_dS, e_Db, consts)
        head_big = wts.row_overflow.any(axis=-1) | (np.fmax.reduce(fp.B, axis=(-1, -2), initial=0.0) >= big)
        ds_over = None
        if consts[-1]:
            # dS rounded to the half format is inf where |dS~| reaches its range (item 5 above).
            ds_over = fp.unmasked & (np.fmin(dS_up + e_S, ds_kernel_bound(fp, wts, model, fmt, E_fwd))
                                     >= fmt.max_finite)
    shared = (wts, e_S, dS_up, head_big, ds_over)
    fp.bwd_cache[model] = (E_fwd, shared)
    return shared


def _qk_cap_cannot_bind(fp: FirstPass, wts: _Weights, model: AttentionTolerance, fmt: Format,
                        E_fwd: np.ndarray, e_S: np.ndarray, dS_up: np.ndarray) -> bool:
    """:func:`cap_cannot_bind` for grad_query and grad_key together, answered once per output gradient
    and model (they read the same arrays; only their depths differ)."""
    hit = fp.bwd_cache.get((model, "qk cap"))
    if hit is not None and hit[0] is E_fwd:
        return hit[1]
    pb = fp.pb
    gds, lengths = [], []
    for which, rows, block in (("query", pb.S, model.grad_query_block), ("key", pb.L, model.grad_key_block)):
        c = pb.copies(which).shape[1]
        gds.append(_g(rows * c + _blocks(rows, block) + 6, wts.u))
        lengths.append(rows * c)
    answer = cap_cannot_bind(fp, wts, model, fmt, "query", (min(gds), max(gds)), max(lengths),
                             shared=(e_S, dS_up))
    fp.bwd_cache[(model, "qk cap")] = (E_fwd, answer)
    return answer


def _copy_sums(summed: np.ndarray, cop: np.ndarray, n: int) -> np.ndarray:
    """Each row's sum of the gradient's concatenation X' of an (H, L, S) array X over its copies
    ``cop``, from ``summed``, X's own float64 sum over the axis that the gradient sums (n terms in
    all), raised by 2 gamma_n for the float64 roundings (the terms are nonnegative): (own heads, rows
    of the gradient)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return up(summed[cop].sum(axis=1) * (1 + 2 * _g(n, 2.0 ** -53)))


def _dS_bound_sums(fp: FirstPass, model: AttentionTolerance, E_fwd: np.ndarray, e_S: np.ndarray,
                   dS_up: np.ndarray) -> dict[int, np.ndarray]:
    """The sums of |dS| + e_S over its keys (axis -1, for grad_query) and over its rows (-2, for
    grad_key), once per output gradient and model: by the compiled loop, a row at a time, or from
    one temporary of the weights' size.  (Made for each gradient, that temporary took about 26 ms
    of each at 1x8x1024x64; both sums from it, 35 to 41 ms, and by the loop 5 to 6, seven calls
    each in turn in one process.)"""
    hit = fp.bwd_cache.get((model, "dS sums"))
    if hit is not None and hit[0] is E_fwd:
        return hit[1]
    done = ds_sums(dS_up, e_S)  # (the same sums, bit for bit)
    if done is not None:
        sums = {-1: done[0], -2: done[1]}
    else:
        with np.errstate(over="ignore", invalid="ignore"):
            X = dS_up + e_S
            sums = {-1: np.sum(X, axis=-1), -2: np.sum(X, axis=-2)}
    fp.bwd_cache[(model, "dS sums")] = (E_fwd, sums)
    return sums


def _rank_one_bound(rows: np.ndarray, absY: np.ndarray, scale: float, n: int) -> np.ndarray:
    """An upper bound on ``scale * matmul_up(X', absY)``, with ``rows`` X''s :func:`_copy_sums`:
    each element is at most its row's sum of X' times its column's largest |Y|, and matmul_up's own
    roundings (about 2 gamma_n, and 2 n TINY) are paid for."""
    g = _g(n, 2.0 ** -53)
    with np.errstate(over="ignore", invalid="ignore"):
        cols = np.max(absY, axis=-2, initial=0.0)  # (own heads, columns)
        out = up((rows[..., :, None] * cols[..., None, :] * (1 + 4 * g + 2.0 ** -48) + 4 * n * TINY) * scale)
    return np.where(np.isnan(out), np.inf, out)


def _dS_row_sums(fp: FirstPass, wts: _Weights, model: AttentionTolerance, fmt: Format, E_fwd: np.ndarray,
                 parts: tuple[np.ndarray, np.ndarray, int], rows: np.ndarray, cop: np.ndarray, n: int
                 ) -> np.ndarray:
    """Upper bounds on a kernel's sum_j |dS~_ij| (grad_query's, axis -1) or sum_i |dS~_ij| (grad_key's,
    -2) over every copy of the gradient's head, as a column: ``rows``, the :func:`_copy_sums` of
    |dS| + e_S (``parts`` = (e_S, |dS| + e_dS, axis)), where finite; where |dS| + e_S is not (no
    relative bound on the weights), from the bound on what a finite computation gives
    (_caps.ds_kernel_bound) in its place."""
    if not np.all(np.isfinite(rows)):
        e_S, dS_up, axis = parts
        with np.errstate(over="ignore", invalid="ignore"):
            dS_bound = dS_up + e_S
            dS_bound = np.where(np.isfinite(dS_bound), dS_bound, ds_kernel_bound(fp, wts, model, fmt, E_fwd))
            rows = _copy_sums(np.sum(dS_bound, axis=axis), cop, n)
    return np.where(np.isnan(rows), np.inf, rows)[..., None]  # (NaN: no bound)


def backward_tolerance(fp: FirstPass, model: AttentionTolerance, fmt: Format, E_fwd: np.ndarray,
                       which: str) -> tuple[np.ndarray, np.ndarray]:
    """E and the overflow marks of one gradient (in its operand's own batch), under ``model``.

    ``E_fwd`` is the forward tolerance of the kernel whose stored output a
    fused backward reads to form D = rowsum(dO * O).
    """
    pb = fp.pb
    wts, e_S, dS_up, head_big, ds_over = _backward_shared(fp, model, fmt, E_fwd)
    u, eta = wts.u, wts.eta
    half = fmt.p < wts.acc.p
    u_o, eta_o = fmt.unit_roundoff, fmt.min_subnormal
    L, S, Ev = pb.L, pb.S, pb.Ev
    rho = wts.rho
    s = pb.scale.magnitude
    big = wts.acc.max_finite / 2
    # A kernel may add grad_query's (grad_key's) products before it multiplies by s: PyTorch's CPU
    # fused kernel adds dS K in a gemm whose alpha is s, and a gemm may apply alpha after its sums.
    # Where s < 1 that sum is 1/s times the gradient's size, and it is what may overflow.
    reach = 1.0 if which == "value" or s >= 1 else 1 / s
    cop = pb.copies(which)
    n_own, c = cop.shape
    n = c * (L if which in ("key", "value") else S)  # the terms of each gradient element's sum
    with np.errstate(over="ignore", invalid="ignore"):
        if which == "value":
            u_p = u_o if (model.weights_in_input_format and half) else 0.0
            eta_p = eta_o if (model.weights_in_input_format and half) else 0.0
            blocks = _blocks(L, model.grad_key_block)
            depth = L * c + blocks + 2
            gd = _g(depth, u)
            grow = (1 + u_p) * (1 + gd) - 1
            absG = fp.absG[cop].reshape(n_own, c * L, Ev)
            Pcat = _cat_rows_t(fp.P_up, cop)
            # coef = P_up (rho + (1 + rho) grow), formed a block of rows at a time by matmul_up.
            E = matmul_up(Pcat, absG, of=factor("relative", grow), more=(_cat_rows_t(rho, cop),))
            colsumG = np.sum(absG, axis=-2)[:, None, :]
            E = E + (eta_p + eta) * (1 + gd) * colsumG + 2 * depth * eta

            def exact_bound() -> np.ndarray:
                return matmul_up(Pcat, absG)
            rank = (absG, 1.0)
            bound = exact_bound() if model.blocks_in_output_format and half else None
            if bound is not None:
                E = E + _g(blocks, u_o) * (bound + E)
        else:
            X, Y = (_cat_cols, fp.Kh) if which == "query" else (_cat_rows_t, fp.Qh)
            rows = S if which == "query" else L
            blocks = _blocks(rows, model.grad_query_block if which == "query" else model.grad_key_block)
            depth = rows * c + blocks + 6
            gd = _g(depth, u)
            absY = np.abs(Y)[cop].reshape(n_own, c * rows, pb.E)
            # X(f(e_S, dS_up)) = f(X(e_S), X(dS_up)) for an elementwise f: matmul_up forms f a
            # block of rows at a time.
            Xe, Xd = X(e_S, cop), X(dS_up, cop)
            E = s * matmul_up(Xe, absY, of=factor("grown", gd), more=(Xd,)) + 2 * depth * eta * (1 + s)

            def exact_bound() -> np.ndarray:
                return s * matmul_up(Xd, absY, of=np.add, more=(Xe,))
            axis = -1 if which == "query" else -2  # (|dS| + e_S summed over dS's keys, or its rows)
            rank = (absY, s)
            row_sums = _copy_sums(_dS_bound_sums(fp, model, E_fwd, e_S, dS_up)[axis], cop, n)
            needed = wts.prescaled or (model.blocks_in_output_format and half)
            bound = exact_bound() if needed else None
            rowsum = _dS_row_sums(fp, wts, model, fmt, E_fwd, (e_S, dS_up, axis), row_sums, cop, n)
            if wts.prescaled:
                # The rounded pre-scaled operand multiplies dS too: u_in of each term, and its
                # underflow eta_in / 2 times |dS| (item 4 above; c's rounding is in the depth's 6).
                E = E + (1 + gd) * (wts.u_in * bound + wts.eta_in * rowsum)
            if model.blocks_in_output_format and half:
                E = E + _g(blocks, u_o) * (bound + E)
        E = up(E * _SLACK)
        E = np.where(np.isfinite(E), E, np.inf)
        # What a finite computation can produce bounds E where the weights' relative bound fails;
        # where that provably never happens, the cap is not computed (the same E and bound).
        skip = (np.all(E < np.inf) and (bound is None or np.all(bound < np.inf))
                and (_qk_cap_cannot_bind(fp, wts, model, fmt, E_fwd, e_S, dS_up) if which != "value" else
                     cap_cannot_bind(fp, wts, model, fmt, which, (gd, gd), n, grow=grow, eta_p=eta_p,
                                     absolute=2 * depth * eta)))
        cap = None if skip else backward_cap(fp, wts, model, fmt, E_fwd, which, depth, blocks)
        if cap is not None:
            E = np.fmin(E, cap)
        # The bound on the sum of |terms| matters only for the overflow marks: where a rank-one
        # bound on it keeps every element below the overflow, its product is not made.
        if bound is None and which == "value":
            row_sums = _copy_sums(np.sum(fp.P_up, axis=-2), cop, n)
        if bound is None and not np.all((_rank_one_bound(row_sums, *rank, n) + E) * reach < big):
            bound = exact_bound()
            if skip and not np.all(bound < np.inf):
                # (cap_cannot_bind's min(bound, cap) = bound needs bound finite.)
                cap = backward_cap(fp, wts, model, fmt, E_fwd, which, depth, blocks)
        if bound is not None and cap is not None:
            bound = np.fmin(bound, cap)
        if which != "value":
            # Item 6 above: the math path's operand scaled by sqrt(s) may underflow.  The cap's
            # bound on the kernel's result needs the term as much as E does, so it comes after.
            E = up(E + up((1 + gd) * math.sqrt(s) * eta * rowsum * _SLACK))
        overflow = np.broadcast_to(head_big[cop].any(axis=1)[:, None, None], E.shape)
        overflow = overflow.copy() if bound is None else ((bound + E) * reach >= big) | overflow
        if ds_over is not None and which != "value":
            # A row of dS with an infinite entry makes its whole row of grad_query (or column,
            # for grad_key) inf or NaN, in every copy it is summed over.
            rows_over = ds_over.any(axis=-1) if which == "query" else ds_over.any(axis=-2)
            overflow = overflow | rows_over[cop].any(axis=1)[:, :, None]
    return E, overflow
