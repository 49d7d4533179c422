"""scaled_dot_product_attention's inputs, read and checked once, in the form every pass uses.

Every broadcast batch element of the output is a *head* ``h``: it reads query
``qi[h]``, key ``ki[h]`` and value ``vi[h]`` of the operands' own (flattened)
batch.  Grouped-query attention and batch broadcasting are both just many
heads reading one key or value, so a gradient sums over the heads that read
its element (its *copies*), and every copy count is the same for all the
elements of one operand.

Non-finite inputs do not enter the exact computation: their elements take
the normal answer (:func:`ieee_math_path`), and a logit that the math path
makes -inf masks its key, as a -inf mask entry does.

Two choices of semantics (docs/attention.md, "Masking semantics"):
``masked_rows`` says what a row with no key to attend gives ("zero":
PyTorch's 0; "mean": JAX's equal weights on the keys its mask hides, all S
of them when the mask hides the whole row, with constant logits, so no
gradient reaches its query or keys), and ``mask_nan`` whether a masked
key's logit reaches the row ("propagate": PyTorch adds the mask's -inf, so a
NaN or infinite logit under the mask makes the row NaN; "hide": JAX replaces
masked logits, so it does not).  A "mean" row is recorded in ``uniform``:
its masked keys become its attended ones and its query row reads as zero
for the exact computation, which makes every logit of the row exactly 0.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import flint
import numpy as np

from ..._convert import _plain, operand, values_of
from ...formats import ComplexFormat, Format

__all__ = ["Problem", "Scale", "read_problem"]

CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")
#: What a row with no key to attend gives: PyTorch's 0, or JAX's equal weights on its masked keys.
MASKED_ROWS = ("zero", "mean")
#: Whether a NaN or infinite logit under the mask reaches its row: PyTorch adds the mask, JAX replaces.
MASK_NAN = ("propagate", "hide")


@dataclass(frozen=True)
class Scale:
    """The softmax scale s: exact, as a rational or as 1/sqrt(n), with a float64 value and its error."""

    approx: float
    err: float
    rational: Fraction | None = None
    root_of: int | None = None  # s == 1/sqrt(root_of), irrational

    def ball(self) -> flint.arb:
        """An Arb ball holding s at the current precision."""
        if self.rational is not None:
            return flint.arb(flint.fmpq(self.rational.numerator, self.rational.denominator))
        return flint.arb(self.root_of).rsqrt()

    @property
    def magnitude(self) -> float:
        """An upper bound on |s|."""
        return abs(self.approx) + self.err


def default_scale(E: int) -> Scale:
    """1/sqrt(E), taken exactly: rational when E is a perfect square."""
    r = math.isqrt(E)
    if r * r == E:
        exact = Fraction(1, r)
        approx = 1.0 / r
        return Scale(approx, abs(float(Fraction(approx) - exact)) * 2, rational=exact)
    approx = 1.0 / math.sqrt(E)
    # sqrt is correctly rounded and the division adds one more rounding.
    return Scale(approx, approx * 2.0 ** -51, root_of=E)


def user_scale(scale: Any) -> Scale:
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scaled_dot_product_attention: scale={scale!r} must be None or a real number")
    value = float(scale)
    if not math.isfinite(value):
        raise ValueError(f"scaled_dot_product_attention: scale={scale!r} must be finite")
    return Scale(value, 0.0, rational=Fraction(value))


@dataclass
class Problem:
    """The exact inputs of one attention call, per head; see the module docstring."""

    fmt: Format
    Q: np.ndarray  # (nq, L, E) float64, exact, non-finite values zeroed
    K: np.ndarray  # (nk, S, E)
    V: np.ndarray  # (nv, S, Ev)
    qi: np.ndarray  # (H,) head -> query batch index
    ki: np.ndarray
    vi: np.ndarray
    batch: tuple[int, ...]
    shapes: dict[str, tuple[int, ...]]
    masked: np.ndarray  # (H, L, S) bool: key j takes no part in row i of head h
    additive: np.ndarray | None  # (H, L, S) float64 finite mask values (0 where masked), or None
    scale: Scale
    raw: dict[str, np.ndarray] = field(default_factory=dict)  # inputs with their non-finite values
    mask_special: np.ndarray | None = None  # (H, L, S) +inf or NaN float mask entries, else None
    is_causal: bool = False
    causal_alignment: str = "top_left"
    masked_rows: str = "zero"
    mask_nan: str = "propagate"
    # (H, L) bool: rows with no key to attend under masked_rows="mean" (see the module docstring).
    uniform: np.ndarray | None = None
    # (H, L, S) bool: the keys the mask (or is_causal) hides, before settle_masks changes ``masked``.
    hidden: np.ndarray | None = None

    @property
    def H(self) -> int:
        return len(self.qi)

    @property
    def L(self) -> int:
        return self.Q.shape[-2]

    @property
    def S(self) -> int:
        return self.K.shape[-2]

    @property
    def E(self) -> int:
        return self.Q.shape[-1]

    @property
    def Ev(self) -> int:
        return self.V.shape[-1]

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.batch + (self.L, self.Ev)

    def flat_shape(self, which: str) -> tuple[int, ...]:
        """The shape the passes' flat indices of output ``which`` count in: (H, L, Ev) for "out",
        the operand's own (flattened batch, rows, features) for a gradient."""
        if which == "out":
            return (self.H, self.L, self.Ev)
        return {"query": self.Q, "key": self.K, "value": self.V}[which].shape

    def copies(self, which: str) -> np.ndarray:
        """(n_own, copies) head indices reading each batch element of operand ``which``."""
        idx = {"query": self.qi, "key": self.ki, "value": self.vi}[which]
        n = {"query": self.Q, "key": self.K, "value": self.V}[which].shape[0]
        order = np.argsort(idx, kind="stable")
        return order.reshape(n, -1)

    @property
    def any_nonfinite(self) -> bool:
        return bool(self.raw) or self.mask_special is not None


def _batch_map(own: tuple[int, ...], full: tuple[int, ...], group: int = 1) -> np.ndarray:
    """Flat index into an operand of batch shape ``own`` for every element of the batch ``full``.

    ``group`` > 1 repeats dim -1 of ``own`` that many times (repeat_interleave),
    as grouped-query attention does with the heads of key and value.
    """
    grids = np.indices(full, dtype=np.int64).reshape(len(full), -1) if full else np.zeros((0, 1), np.int64)
    lead = len(full) - len(own)
    flat = np.zeros(grids.shape[1], dtype=np.int64)
    for d, n in enumerate(own):
        coord = grids[lead + d]
        if d == len(own) - 1 and group > 1:
            coord = coord // group
        elif n == 1:
            coord = np.zeros_like(coord)
        flat = flat * n + coord
    return flat


def _read_input(obj: Any, name: str) -> tuple[np.ndarray, Format]:
    o = operand(obj, name)
    if o.tier == 0 or o.array.ndim < 2:
        raise ValueError(f"scaled_dot_product_attention: {name} must have at least 2 dimensions "
                         f"(..., positions, features), got shape {o.array.shape}")
    if isinstance(o.fmt, ComplexFormat):
        raise TypeError(f"scaled_dot_product_attention: {name} has dtype {o.fmt.name}; attention takes "
                        "real formats only")
    return values_of(o, o.fmt), o.fmt


def _read_mask(attn_mask: Any) -> np.ndarray:
    try:
        arr = np.asarray(_plain(attn_mask))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"scaled_dot_product_attention: attn_mask={attn_mask!r:.60} cannot be read as an "
                        f"array: {exc}") from None
    if arr.dtype == np.bool_:
        return arr
    if arr.dtype.kind == "f" or arr.dtype.name == "bfloat16":
        return arr.astype(np.float64)
    raise TypeError(f"scaled_dot_product_attention: attn_mask has dtype {arr.dtype}; it must be bool "
                    "(attend where True) or a float format (added to the logits)")


def check_semantics(masked_rows: Any, mask_nan: Any) -> None:
    """Raise, naming the argument, unless ``masked_rows`` and ``mask_nan`` are among their choices."""
    op = "scaled_dot_product_attention"
    for value, name, choices, what in (
            (masked_rows, "masked_rows", MASKED_ROWS, "'zero' (PyTorch: a row with every key masked gives 0) or "
             "'mean' (JAX: it gives the mean of value over the keys)"),
            (mask_nan, "mask_nan", MASK_NAN, "'propagate' (PyTorch adds the mask, so a NaN logit under it "
             "makes its row NaN) or 'hide' (JAX replaces masked logits)")):
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"{op}: {name}={value!r} must be one of {choices}: {what}")


def read_problem(query: Any, key: Any, value: Any, attn_mask: Any, dropout_p: Any, is_causal: Any,
                 scale: Any, enable_gqa: Any, causal_alignment: Any, masked_rows: Any = "zero",
                 mask_nan: Any = "propagate") -> Problem:
    """Read and check the arguments of scaled_dot_product_attention; raise naming the bad one."""
    op = "scaled_dot_product_attention"
    check_semantics(masked_rows, mask_nan)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"{op}: dropout_p={dropout_p!r} must be a number, and 0")
    if dropout_p != 0:
        raise ValueError(f"{op}: dropout_p={dropout_p!r} is not supported: dropout is random, so it has no "
                         "exact value; pass dropout_p=0.0 (and test a kernel's dropout separately)")
    for flag, name in ((is_causal, "is_causal"), (enable_gqa, "enable_gqa")):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{op}: {name}={flag!r} must be a bool")
    if causal_alignment not in CAUSAL_ALIGNMENTS:
        raise ValueError(f"{op}: causal_alignment={causal_alignment!r} must be one of {CAUSAL_ALIGNMENTS}")
    if causal_alignment != "top_left" and not is_causal:
        raise ValueError(f"{op}: causal_alignment={causal_alignment!r} only applies with is_causal=True")
    if is_causal and attn_mask is not None:
        raise ValueError(f"{op}: is_causal=True and an attn_mask were both given; as in PyTorch, pass one "
                         "of them (is_causal builds its own mask)")

    Q, fq = _read_input(query, "query")
    K, fk = _read_input(key, "key")
    V, fv = _read_input(value, "value")
    if not fq == fk == fv:
        raise TypeError(f"{op}: query, key and value must have one dtype, got {fq.name}, {fk.name} and "
                        f"{fv.name}")
    fmt = fq
    L, E = Q.shape[-2:]
    S = K.shape[-2]
    if K.shape[-1] != E:
        raise ValueError(f"{op}: query has {E} features (shape {Q.shape}) but key has {K.shape[-1]} "
                         f"(shape {K.shape}); their last dimensions must match")
    if V.shape[-2] != S:
        raise ValueError(f"{op}: key has {S} positions (shape {K.shape}) but value has {V.shape[-2]} "
                         f"(shape {V.shape}); their second-to-last dimensions must match")
    if E == 0 and scale is None:
        raise ValueError(f"{op}: query has 0 features (shape {Q.shape}), so the default scale 1/sqrt(0) "
                         "is infinite; pass a scale")
    sc = default_scale(E) if scale is None else user_scale(scale)

    qb, kb, vb = Q.shape[:-2], K.shape[:-2], V.shape[:-2]
    group = 1
    if enable_gqa and len(qb) >= 1 and len(kb) >= 1 and len(vb) >= 1 and (kb[-1] != qb[-1] or vb[-1] != qb[-1]):
        hq, hk, hv = qb[-1], kb[-1], vb[-1]
        if hk != hv or hk == 0 or hq % hk:
            raise ValueError(f"{op}: with enable_gqa=True, the heads of key ({hk}) and value ({hv}) must be "
                             f"equal and divide the heads of query ({hq}) (dimension -3)")
        group = hq // hk
        kb_eff, vb_eff = kb[:-1] + (hq,), vb[:-1] + (hq,)
    else:
        kb_eff, vb_eff = kb, vb
    try:
        batch = tuple(np.broadcast_shapes(qb, kb_eff, vb_eff))
    except ValueError:
        hint = "; grouped-query attention needs enable_gqa=True" if (len(qb) and len(kb) and qb[-1] != kb[-1]
                                                                     and not enable_gqa) else ""
        raise ValueError(f"{op}: the batch dimensions of query {qb}, key {kb} and value {vb} do not "
                         f"broadcast{hint}") from None
    qi = _batch_map(qb, batch)
    ki = _batch_map(kb, batch, group if kb_eff != kb else 1)
    vi = _batch_map(vb, batch, group if vb_eff != vb else 1)
    H = len(qi)
    if H * L * S * 8 * 40 > 1 << 36:
        raise ValueError(f"{op}: {H} heads of {L} x {S} attention weights need more working memory than "
                         "ExactRef allows (about 64 GiB); use smaller inputs")

    masked = np.zeros((H, L, S), dtype=bool)
    additive = None
    mask_special = None
    if attn_mask is not None:
        m = _read_mask(attn_mask)
        try:
            full = np.broadcast_shapes(batch + (L, S), m.shape)
        except ValueError:
            full = None
        if full != batch + (L, S):
            raise ValueError(f"{op}: attn_mask has shape {m.shape}, which does not broadcast to the "
                             f"attention weights' shape {batch + (L, S)}")
        m = np.broadcast_to(m, batch + (L, S)).reshape(H, L, S)
        if m.dtype == np.bool_:
            masked = ~m
        else:
            masked = m == -np.inf
            bad = np.isnan(m) | (m == np.inf)
            if bad.any():
                mask_special = np.where(bad, m, 0.0)
            finite = np.where(np.isfinite(m), m, 0.0)
            if finite.any():
                additive = finite
    if is_causal:
        i = np.arange(L)[:, None]
        j = np.arange(S)[None, :]
        allowed = j <= i if causal_alignment == "top_left" else j <= i + (S - L)
        masked = np.broadcast_to(~allowed, (H, L, S)).copy()

    raw = {}
    for name, arr in (("query", Q), ("key", K), ("value", V)):
        if not np.isfinite(arr).all():
            raw[name] = arr
    own = {"query": Q, "key": K, "value": V}

    def per_batch(a: np.ndarray) -> np.ndarray:
        return a.reshape((math.prod(a.shape[:-2]),) + a.shape[-2:])

    flat = {n: per_batch(np.where(np.isfinite(a), a, 0.0)) for n, a in own.items()}
    return Problem(fmt=fmt, Q=flat["query"], K=flat["key"], V=flat["value"], qi=qi, ki=ki, vi=vi,
                   batch=batch, shapes={"query": Q.shape, "key": K.shape, "value": V.shape},
                   masked=masked, additive=additive, scale=sc,
                   raw={n: per_batch(a) for n, a in raw.items()},
                   mask_special=mask_special, is_causal=bool(is_causal),
                   causal_alignment=causal_alignment, masked_rows=masked_rows, mask_nan=mask_nan)


def _sign_class(x: np.ndarray) -> np.ndarray:
    # Finite values become their sign, so nothing overflows, while 0, +-inf and
    # NaN keep their IEEE behaviour in products, sums and the softmax.
    return np.where(np.isfinite(x), np.sign(x), x)


def _math_path(pb: Problem, q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray | None,
               additive: np.ndarray | None, dtype: type) -> dict[str, np.ndarray]:
    """The math path in IEEE arithmetic of ``dtype``, per head (q, k already scaled), under pb's semantics."""
    masked = pb.masked if pb.hidden is None else pb.hidden
    x = np.einsum("hle,hse->hls", q, k).astype(dtype)
    if additive is not None:
        x = x + additive.astype(dtype)
    if pb.mask_special is not None:
        x = x + pb.mask_special.astype(dtype)
    if pb.mask_nan == "hide":
        # JAX replaces a masked logit, so whatever q k^T held there is gone.
        x = np.where(masked, -np.inf, x).astype(dtype)
    else:
        # PyTorch adds the mask's -inf, so an infinite or NaN logit under it becomes NaN.
        x = x + np.where(masked, -np.inf, 0.0).astype(dtype)
    top = np.max(x, axis=-1, keepdims=True) if pb.S else np.full(x.shape[:-1] + (1,), -np.inf, dtype)
    empty = top == -np.inf
    e = np.where(empty, 0.0, np.exp(x - np.where(empty, 0.0, top))).astype(dtype)
    total = np.sum(e, axis=-1, keepdims=True)
    P = np.where(empty, 0.0, e / np.where(empty, 1.0, total)).astype(dtype)
    const = None
    if pb.masked_rows == "mean":
        # A row with nothing to attend weighs its masked keys equally (JAX's finite fill); with no
        # masked key (every logit -inf) it is exp(-inf - -inf) = NaN.
        n = masked.sum(axis=-1, keepdims=True)
        uniform = np.where(n > 0, masked / np.maximum(n, 1), np.nan).astype(dtype)
        P = np.where(empty, uniform, P).astype(dtype)
        const = empty & masked  # constant weights: no gradient reaches their logits
    result = {"out": np.einsum("hls,hsc->hlc", P, v), "x": x}
    if g is not None:
        dP = np.einsum("hlc,hsc->hls", g, v)
        D = np.sum(dP * P, axis=-1, keepdims=True)
        dS = P * (dP - D)
        if pb.mask_nan == "hide":
            dS = np.where(masked, 0.0, dS)  # the gradient of a replaced logit is exactly 0
        if const is not None:
            dS = np.where(const, 0.0, dS)
        result["grad_query"] = np.einsum("hls,hse->hle", dS, k)
        result["grad_key"] = np.einsum("hls,hle->hse", dS, q)
        result["grad_value"] = np.einsum("hls,hlc->hsc", P, g)
    return result


def ieee_math_path(pb: Problem, G: np.ndarray | None) -> dict[str, np.ndarray]:
    """Where the math path, run in IEEE arithmetic, gives NaN or +-inf; and which logits are -inf.

    The math path is PyTorch's, or with ``pb.masked_rows`` and ``pb.mask_nan``
    JAX's masking (see the module docstring).

    Non-finite inputs decide where a special value appears: that is found on
    sign classes of the inputs (finite values replaced by their sign), where
    nothing overflows.  Which special value it is comes from the math path
    run on the real values in the accumulation format (float32 for half
    inputs), since a weight that underflows to 0 there makes 0 * inf = NaN.
    Returns float64 arrays, 0 where the result is finite: ``out`` (H, L, Ev)
    and, with the output gradient ``G`` (H, L, Ev), ``grad_query``,
    ``grad_key``, ``grad_value`` in each operand's own batch; and
    ``neg_inf_logit`` (H, L, S) bool.
    """
    raw = {n: pb.raw.get(n, a) for n, a in (("query", pb.Q), ("key", pb.K), ("value", pb.V))}
    s = pb.scale.approx
    sq, sk = (0.0, 0.0) if s == 0 else (math.copysign(1.0, s), 1.0)
    dtype = np.float64 if pb.fmt.p > 24 else np.float32
    sigma = math.sqrt(abs(s))
    with np.errstate(invalid="ignore", over="ignore", divide="ignore", under="ignore"):
        signs = _math_path(pb, _sign_class(raw["query"])[pb.qi] * sq, _sign_class(raw["key"])[pb.ki] * sk,
                           _sign_class(raw["value"])[pb.vi], None if G is None else _sign_class(G),
                           None if pb.additive is None else _sign_class(pb.additive), np.float64)
        special = {n: ~np.isfinite(a) for n, a in signs.items() if n != "x"}
        real = None
        if any(a.any() for a in special.values()):
            cast = (lambda a: a.astype(dtype))
            real = _math_path(pb, cast(raw["query"][pb.qi] * (sigma * (sq or 1.0))), cast(raw["key"][pb.ki] * sigma),
                              cast(raw["value"][pb.vi]), None if G is None else cast(G), pb.additive, dtype)
        hidden = pb.masked if pb.hidden is None else pb.hidden
        result = {"neg_inf_logit": (signs["x"] == -np.inf) & ~hidden}
        for name, where in special.items():
            value = signs[name]
            if real is not None:
                r = real[name].astype(np.float64)
                value = np.where(np.isfinite(r), value, r)
            value = np.where(where, value, 0.0)
            if name != "out":
                which = name.removeprefix("grad_")
                cop = pb.copies(which)
                # A copy's special value spreads into the sum; NaN wins, and opposite infinities make NaN.
                value = value[cop].sum(axis=1)
                value = np.where(np.isfinite(value), 0.0, value)
            result[name] = value
    return result


def settle_masks(pb: Problem, neg_inf_logit: np.ndarray | None) -> None:
    """Fix ``pb.masked`` (and ``pb.uniform``) for the exact computation, in place.

    A logit the math path makes -inf masks its key, as a -inf mask entry
    does.  Under ``masked_rows="mean"`` a row left with no key to attend
    weighs the keys its mask hides equally: they become its attended keys,
    with constant logits, and the row is marked in ``pb.uniform``.  A row
    whose mask hides nothing but whose every logit is -inf is NaN in JAX;
    :func:`ieee_math_path` says so, and it stays fully masked here.
    """
    hidden = pb.masked if pb.hidden is None else pb.hidden
    pb.hidden = hidden  # the backward's math path reads the mask itself, not what -inf logits added
    masked = hidden if neg_inf_logit is None else hidden | neg_inf_logit
    if pb.masked_rows == "mean" and pb.S:
        uniform = masked.all(axis=-1) & hidden.any(axis=-1)
        if uniform.any():
            masked = masked.copy()
            masked[uniform] = ~hidden[uniform]
            pb.uniform = uniform
    pb.masked = masked
