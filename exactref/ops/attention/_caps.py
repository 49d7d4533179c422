"""Caps on attention's tolerances from what a finite computation of each class can produce.

The models of ``_model`` bound a kernel's error through the relative error
of its weights, which has no finite bound once the logits' own rounding
errors reach a fraction of a nat (|logits| beyond about 2**20 in float32):
those tolerances become inf, and a leaky causal fill then passes.  The caps
here need no relative bound on the weights; each tolerance is the smaller of
the two (docs/attention.md, "Caps").

* Forward: every kernel of every class divides the weights it sums by the
  sum of the same weights (a softmax, or an online softmax's final O / l),
  so its output lies in the hull of the unmasked value rows, widened by the
  roundings that make the normalised weights sum to sigma != 1.
* Backward: a fused kernel recomputes its weights from a stored logsumexp,
  without normalising, so they may exceed 1, but by at most
  exp(delta_ij + max_k delta_ik) times the exp's error; that bounds |P~|,
  then |dS~| and each gradient's sum of |terms|.  The cap is the bound on
  the exact value plus the bound on the kernel's.
"""

from __future__ import annotations

import numpy as np

from ...engine.fast import gamma, up
from ...formats import Format
from . import _loops
from ._first import FirstPass, _cat_cols, _cat_rows_t, by_rows, expm1_up, matmul_up

__all__ = ["backward_cap", "cap_cannot_bind", "ds_kernel_bound", "forward_cap"]

_SLACK = 1.0 + 2.0 ** -20
_CHUNK = 1 << 22  # elements of the (rows, S, Ev) working array of the hull


def _g(n: int, u: float) -> float:
    return float(gamma(max(n, 0), u)) * (1 + 2.0 ** -40)


def _hull(fp: FirstPass) -> tuple[np.ndarray, np.ndarray]:
    """min_j v_jc and max_j v_jc over the keys j that row i attends to, (H, L, Ev); 0 for empty rows."""
    H, L, S = fp.unmasked.shape
    Ev = fp.Vh.shape[-1]
    # A row that attends to every key (no mask, the common case) has its head's column extremes.
    lo = np.broadcast_to(np.min(fp.Vh, axis=1, initial=np.inf)[:, None, :], (H, L, Ev)).copy()
    hi = np.broadcast_to(np.max(fp.Vh, axis=1, initial=-np.inf)[:, None, :], (H, L, Ev)).copy()
    hs, rows = np.nonzero(~fp.unmasked.all(axis=-1))
    step = max(1, _CHUNK // max(1, S * Ev))
    for a in range(0, len(hs), step):
        h, i = hs[a:a + step], rows[a:a + step]
        um = fp.unmasked[h, i][:, :, None]  # (n, S, 1)
        V = fp.Vh[h]  # (n, S, Ev)
        lo[h, i] = np.min(np.where(um, V, np.inf), axis=1, initial=np.inf)
        hi[h, i] = np.max(np.where(um, V, -np.inf), axis=1, initial=-np.inf)
    empty = ~np.isfinite(lo)
    return np.where(empty, 0.0, lo), np.where(empty, 0.0, hi)


def sigma_error(S: int, nb: int, u: float, eta: float, u_p: float, eta_p: float) -> tuple[float, float, float]:
    """(|sigma - 1| bound, sigma's upper bound, gamma) for the normalised weights sigma = sum_j a_j.

    a_j = q_j (1 + t_j) / sum_k q_k (1 + t'_k) for nonnegative q (the exps and
    rescalings, however inexact: they are the same in both sums), |t|, |t'| <=
    gamma_N over the N = S + 2 nb + 4 roundings of a product, a sum in any order
    and the block rescalings, one more u for the division, u_p for the weights'
    rounding to a half format, and underflows of at most eta + eta_p per weight
    against a denominator of at least 1/2 (its largest term is exp(0)).
    """
    N = S + 2 * nb + 4
    gN = _g(N, u)
    absolute = 4 * N * (eta + eta_p)
    sig_hi = (1 + gN) * (1 + u_p) * (1 + u) / (1 - gN) + absolute
    sig_lo = (1 - gN) * (1 - u_p) * (1 - u) / (1 + gN) - absolute
    return max(sig_hi - 1, 1 - sig_lo), sig_hi, gN


def forward_cap(fp: FirstPass, wts, u_p: float, eta_p: float) -> np.ndarray:
    """The cap (H, L, Ev) on the forward tolerance: the exact value's distance to the widened hull.

    With a_j >= 0 summing to sigma and v_j in [lo, hi], sum_j a_j v_j lies in
    [sigma lo, sigma hi], within |sigma - 1| max|v| of [lo, hi]; the sum's
    roundings add gamma_N sigma max|v|, its underflows 2 N eta.
    """
    pb = fp.pb
    u, eta = wts.u, wts.eta
    s1, sig_hi, gN = sigma_error(pb.S, wts.nb, u, eta, u_p, eta_p)
    lo, hi = _hull(fp)
    with np.errstate(over="ignore", invalid="ignore"):
        m = np.maximum(np.abs(lo), np.abs(hi))
        widen = (s1 + gN * sig_hi) * m + 2 * (pb.S + 2 * wts.nb + 4) * eta
        cap = np.maximum(hi - (fp.O - fp.rad_O), (fp.O + fp.rad_O) - lo) + widen
        cap = up(np.maximum(cap, 0.0) * _SLACK)
    return np.where(np.isfinite(cap), cap, np.inf)


def _kernel_weights(unmasked: np.ndarray, delta: np.ndarray, r: np.ndarray, rho: np.ndarray,
                    P_up: np.ndarray, F: float) -> np.ndarray:
    """An upper bound on a kernel's |P~_ij| (some rows), normalised or recomputed from a stored logsumexp.

    A normalised weight is at most F (the exp's and the sums' roundings); one
    recomputed as exp(x~_ij - lse~_i) is at most exp(delta_ij + max_k delta_ik
    + r_i) F, since lse~_i >= max_k x~_ik up to the errors already in delta.
    The smaller of that and the model's P (1 + rho), where finite.
    """
    dmax = np.max(np.where(unmasked, delta, 0.0), axis=-1, initial=0.0)
    recomputed = up((1 + expm1_up(delta + dmax[..., None] + r[..., None])) * F)
    relative = np.where(np.isfinite(rho), up(P_up * (1 + rho)), np.inf)
    Pk = np.fmin(recomputed, relative)
    return np.where(unmasked, Pk, 0.0)


def _caps_rows(unmasked, B, P_up, dS, e_dS, absG, O, rad_O, E_fwd, delta, r, rho, consts):
    """(kernel |P~| bound, exact |dS| bound, kernel |dS~| bound) of some rows (see _dS_caps)."""
    F, u, eta, u_o, eta_o, g_v, g_s, S, Ev, ds_rounded = consts
    with np.errstate(over="ignore", invalid="ignore"):
        Pk = _kernel_weights(unmasked, delta, r, rho, P_up, F)
        # The exact dS: P <= 1 and |D| <= max_j |dP_ij|, or the first pass's own bound.
        Bmax = np.max(np.where(unmasked, B, 0.0), axis=-1, initial=0.0)[..., None]
        dS_x = np.fmin(np.abs(dS) + e_dS, up(np.minimum(P_up, 1.0) * (B + Bmax)))
        # The kernel's: |dP~| from gamma_{Ev+1}, D~ as rowsum(P~ dP~) or rowsum(dO O~), the larger.
        dP_k = up((1 + g_v) * B + 2 * Ev * eta)
        D_a = (1 + g_s) * np.sum(Pk * dP_k, axis=-1) + S * eta
        o_k = (np.abs(O) + rad_O + E_fwd) * (1 + u_o) + eta_o
        D_b = (1 + g_v) * np.einsum("nc,nc->n", absG, o_k) + Ev * eta
        D_k = np.maximum(D_a, D_b)[..., None]
        dS_k = Pk * (dP_k + D_k) * (1 + u) ** 2 + eta
        if ds_rounded:
            dS_k = dS_k * (1 + u_o) + eta_o
        dS_k = up(np.where(unmasked, dS_k, 0.0))
        dS_x = np.where(unmasked, dS_x, 0.0)
    return Pk, dS_x, dS_k


def _dS_caps(fp: FirstPass, wts, model, fmt: Format, E_fwd: np.ndarray) -> tuple[np.ndarray, np.ndarray,
                                                                                  np.ndarray]:
    """(kernel |P~| bound, exact |dS| bound, kernel |dS~| bound), each (H, L, S), by blocks of rows
    whose temporaries stay in the cache (every step is elementwise or a sum along a row)."""
    key = (model, "caps")
    hit = fp.bwd_cache.get(key)
    if hit is not None and hit[0] is E_fwd:
        return hit[1]
    pb = fp.pb
    half = fmt.p < wts.acc.p
    consts = (wts.F, wts.u, wts.eta, fmt.unit_roundoff, fmt.min_subnormal, _g(pb.Ev + 1, wts.u),
              _g(pb.S + wts.nb + 1, wts.u), pb.S, pb.Ev, bool(model.ds_in_input_format and half))
    E_rows = np.broadcast_to(E_fwd, fp.O.shape)
    caps = tuple(by_rows(_caps_rows, pb.H, pb.L, fp.unmasked, fp.B, fp.P_up, fp.dS, fp.e_dS, fp.absG, fp.O,
                         fp.rad_O, E_rows, wts.delta, wts.r, wts.rho, consts))
    fp.bwd_cache[key] = (E_fwd, caps)
    return caps


def ds_kernel_bound(fp: FirstPass, wts, model, fmt: Format, E_fwd: np.ndarray) -> np.ndarray:
    """An upper bound (H, L, S) on a kernel's |dS~|, finite even where the weights' relative bound is not."""
    return _dS_caps(fp, wts, model, fmt, E_fwd)[2]


def backward_cap(fp: FirstPass, wts, model, fmt: Format, E_fwd: np.ndarray, which: str,
                 depth: int, blocks: int) -> np.ndarray:
    """The cap on one gradient's tolerance, in its operand's own batch: |exact| + |kernel| bounds.

    ``depth`` is the model's summation depth for the gradient (its gamma), ``blocks``
    its number of blocks, whose running sums a class may store in the output format.
    """
    pb = fp.pb
    u, eta = wts.u, wts.eta
    u_o, eta_o = fmt.unit_roundoff, fmt.min_subnormal
    half = fmt.p < wts.acc.p
    Pk, dS_x, dS_k = _dS_caps(fp, wts, model, fmt, E_fwd)
    cop = pb.copies(which)
    n_own, c = cop.shape
    gd = _g(depth, u)
    s = pb.scale.magnitude
    with np.errstate(over="ignore", invalid="ignore"):
        if which == "value":
            if model.weights_in_input_format and half:
                Pk = np.where(fp.unmasked, Pk * (1 + u_o) + eta_o, 0.0)
            absG = fp.absG[cop].reshape(n_own, c * pb.L, pb.Ev)
            exact = matmul_up(_cat_rows_t(fp.P_up, cop), absG, of=lambda P: np.minimum(P, 1.0))
            kernel = (1 + gd) * matmul_up(_cat_rows_t(Pk, cop), absG) + 2 * depth * eta
        else:
            X, Y = (_cat_cols, fp.Kh) if which == "query" else (_cat_rows_t, fp.Qh)
            rows = pb.S if which == "query" else pb.L
            absY = np.abs(Y)[cop].reshape(n_own, c * rows, pb.E)
            exact = s * matmul_up(X(dS_x, cop), absY)
            kernel = (1 + gd) * s * matmul_up(X(dS_k, cop), absY) + 2 * depth * eta * (1 + s)
            if wts.prescaled:
                # The kernel's operand is the rounded pre-scaled one: |k'| <= |k c| (1 + u_in) + eta_in.
                kernel = kernel * (1 + wts.u_in) + (1 + gd) * wts.eta_in * np.sum(X(dS_k, cop), axis=-1)[..., None]
        if model.blocks_in_output_format and half:
            kernel = kernel * (1 + _g(blocks, u_o)) + blocks * eta_o
        cap = up((exact + kernel) * _SLACK)
    return np.where(np.isfinite(cap), cap, np.inf)


def cap_cannot_bind(fp: FirstPass, wts, model, fmt: Format, which: str, gd: tuple[float, float], n: int,
                    shared: tuple[np.ndarray, np.ndarray] | None = None, grow: float = 0.0,
                    eta_p: float = 0.0, absolute: float = 0.0) -> bool:
    """Whether min(E, cap) = E and min(bound, cap) = bound for every element of a gradient, proven
    from bounds below on the cap that need none of its products (then :func:`backward_cap` is not
    computed: at 1x8x1024x64 float32 it took 0.18 s of a 2 s forward and backward).

    ``gd`` is the least and the largest gamma_depth the answer must hold for (grad_query's and
    grad_key's, answered once for both: each condition below is the harder for the larger on E's
    side and the smaller on the cap's), ``n`` the longest product; ``shared`` holds (e_S,
    |dS| + e_dS) for grad_query and grad_key; ``grow``, ``eta_p`` and ``absolute`` (2 depth eta)
    are grad_value's.  Models that pre-scale an operand or store the running sums in the output
    format add terms whose order this does not follow: for them the cap is computed.

    The lower bounds: a kernel's |P~| bound Pk is at least min(P_up, 1) (its recomputed bound is
    at least F >= 1, its relative one P_up (1 + rho)), and its |dS~| bound at least Pk B (dP_k >= B,
    D_k >= 0).  Each condition below holds with a margin m = 4 gamma_n + 2**-44 for the roundings
    of both sides' products (matmul_up errs by at most about 2 gamma_n; the sums and scalings of
    the results by a few u), so each product on E's side stays below its counterpart in the cap:

    * grad_query, grad_key: E's terms e + gd (d + e) and bound's d + e (e = e_S, d = |dS| + e_dS),
      against the cap's d (its exact |dS| bound is d where d <= min(P_up, 1) (B + max_row B), the
      other term of its fmin) plus (1 + gd) Pk B: e + gd (d + e) and e + m (d + e) (implied by
      the first where m <= gd) at most (1 + gd) min(P_up, 1) B, both times 1 + m.
    * grad_value: E's P_up (rho + (1 + rho) grow) at most (1 + gd) min(P_up, 1) (times 1 + m), which
      with no P_up above 1 is (rho + (1 + rho) grow) at most 1 + gd, at the largest rho; its absolute
      term (eta_p + eta) (1 + gd) sum|dO| below half the cap's min(P_up, 1) |dO| (every weight at
      least twice (eta_p + eta) (1 + gd) (1 + m)), which is at least 2 depth eta, the term the two
      sides add in different orders; bound's P_up is the cap's min(P_up, 1).

    Both sides add 2 depth eta (1 + s) and round the same way otherwise, and rounding is monotone,
    so E comes out at most the cap (tested against computing it, tests/exactref/test_attention_bounds.py).
    No masked key: a masked weight's terms are up(0) on both sides, with no margin between them.
    """
    if wts.prescaled or (model.blocks_in_output_format and fmt.p < wts.acc.p) or not fp.unmasked.all():
        return False
    g_lo, g_hi = gd
    m = 4 * float(gamma(n, 2.0 ** -53)) + 2.0 ** -44
    lo, hi = 1 - 2.0 ** -50, (1 + m) * (1 + 2.0 ** -50)
    if which == "value":
        pm_min = float(np.min(fp.P_up, initial=np.inf))
        colsum_min = float(np.min(np.sum(fp.absG, axis=-2), initial=np.inf))
        rho_max = float(np.max(wts.rho, initial=0.0))  # (NaN where any is: then no test passes)
        with np.errstate(over="ignore", invalid="ignore"):
            return bool(np.max(fp.P_up, initial=0.0) <= 1 and pm_min >= (eta_p + wts.eta) * (1 + g_hi) * hi * 2
                        and pm_min * colsum_min * lo >= absolute
                        and (rho_max + (1 + rho_max) * grow) * hi <= (1 + g_lo) * lo)
    e_S, d = shared
    ok = by_rows(_dS_rows, *fp.P_up.shape[:2], fp.P_up, fp.B, e_S, d, (g_lo, g_hi, m, lo, hi))
    return bool(np.all(ok[0]))


def _dS_rows(P_up, B, e, d, consts):
    """Per row: cap_cannot_bind's conditions for grad_query and grad_key (by the compiled loop where
    it applies: the same answers from the same operations, in one pass over each row instead of a
    dozen over each block; at 1x8x1024x64 float32, grad_query's and grad_key's answer took 10 to 17
    ms against 33 to 42, seven calls each in turn in one process)."""
    done = _loops.cap_rows(P_up, B, e, d, consts)
    if done is not None:
        return (done,)
    g_lo, g_hi, m, lo, hi = consts
    with np.errstate(over="ignore", invalid="ignore"):
        pm = np.minimum(P_up, 1.0)
        below = (1 + g_lo) * lo * pm * B  # <= (1 + gd) times the kernel's |dS~| bound
        de = d + e
        ok = (e + g_hi * de) * hi <= below
        if m > g_lo:
            ok &= (e + m * de) * hi <= below
        # The cap's exact |dS| bound: fmin(d, up(min(P_up, 1) (B + Bmax))) is d (no key is masked).
        Bmax = np.max(B, axis=-1, initial=0.0)[..., None]
        ok &= d <= pm * (B + Bmax)
    return (np.all(ok, axis=-1),)
