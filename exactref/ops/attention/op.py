"""scaled_dot_product_attention: forward, backward, tolerances and normal answers.

Semantics are those of PyTorch's math path (``_scaled_dot_product_attention_math``):

* ``softmax(s Q K^T + mask) V`` with s = ``scale``, by default exactly
  1/sqrt(E) (the irrational number, not its float);
* a bool mask attends where True; a float mask is added to the logits, and
  its -inf entries mask like False; ``is_causal`` masks key j from query i
  when j > i (aligned top-left), or, with ``causal_alignment="bottom_right"``,
  when j > i + S - L, as FlashAttention 2.1 and later do;
* a row whose every key is masked gives 0, as PyTorch's ``_safe_softmax``
  does, and its gradients are 0; with ``masked_rows="mean"`` it gives, as
  JAX's finite fill does, the mean of v over its S keys (equal weights on
  the keys its mask hides), whose logits are constants: grad_value gets
  dO/S per key, grad_query and grad_key nothing;
* the mask is added to the logits, so a NaN or infinite logit under it
  (a NaN or inf in a key, say) makes its row NaN, as in PyTorch; with
  ``mask_nan="hide"`` masked logits are replaced, as JAX does, and do not
  reach the row;
* batch dimensions broadcast, and with ``enable_gqa`` the heads of key and
  value are repeated (``repeat_interleave``) to the query's;
* dropout is refused: it is random, so it has no exact value.

The backward returns ``grad_query = s dS K``, ``grad_key = s dS^T Q`` and
``grad_value = P^T dO`` with ``dP = dO V^T``, ``D = rowsum(P * dP)`` and
``dS = P * (dP - D)``; each is summed over the broadcast copies and GQA groups
of its operand and rounded once.  A float mask gets no gradient.

How each element is decided (first pass, Arb, exact analysis) is in
``_certified``; the tolerance models are in ``_model``
and derived in docs/attention.md.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable
from typing import Any

import numpy as np

from ..._threads import own_threads
from ...errors import OutOfToleranceError, SpecialValueError
from ...formats import Format
from ...result import Gradients, Result, judge
from ...rounding import decide, enclosure_bounds, next_down, next_up
from .._common import Op, read_grad
from . import _second as second
from ._certified import DEFAULT_BUDGET, Refiner
from ._double import DoublePass
from ._first import FirstPass
from ._model import AttentionTolerance, backward_tolerance, forward_tolerance
from ._problem import Problem, ieee_math_path, read_problem, settle_masks

__all__ = ["AttentionAlgorithm", "AttentionTolerance", "scaled_dot_product_attention"]

OP = "scaled_dot_product_attention"
_CPU_KV_SPLIT = 512  # kv_split_size of PyTorch's CPU flash kernel
_CPU_Q_SPLIT = 32  # its smallest q_split_size
# The longdouble second pass runs for outputs of at most this precision: of a float64 output's
# undecided elements it decides about one in five, at more than Arb would spend on them.  Wider
# outputs (and every output where longdouble is float64) get the double-double pass instead.
_SECOND_PASS_MAX_P = 24

Passes = tuple[tuple["second.SecondPass | DoublePass", ...], Refiner]


def _passes(pb: Problem, fp: FirstPass, G: np.ndarray | None, budget: float) -> Passes:
    """The second passes that suit the output format, in order, and the Arb refinement after them.

    A narrow result's few undecided elements go to the longdouble pass, and what it leaves of
    grad_key and grad_value (a whole head's worth of Arb work each) to the double-double pass, for
    the heads they need; a float64 result goes straight to the double-double pass.
    """
    if second.available() and pb.fmt.p <= _SECOND_PASS_MAX_P:
        seconds: tuple = (second.SecondPass(pb, fp, G), DoublePass(pb, fp, G, rows_too=False))
    else:
        seconds = (DoublePass(pb, fp, G),)
    return seconds, Refiner(pb, fp, OP, G, budget)


class AttentionAlgorithm(enum.Enum):
    """The algorithm classes attention is judged under; the names are ``torch.nn.attention.SDPBackend``'s.

    Each member carries ``tolerance`` (its forward model) and
    ``backward_tolerance``, both :class:`AttentionTolerance`.

    MATH
        PyTorch's math path: half inputs upcast to float32, sqrt(s) applied
        to q and to k, a float32 softmax, two matmuls, and autograd through
        them.  The class also holds PyTorch's CPU fused kernel
        (``_scaled_dot_product_flash_attention_for_cpu`` and its backward) for
        float32 and float64 inputs, which CPU dispatch picks by default.
    FLASH_ATTENTION
        Fused kernels with an online softmax over blocks of keys, the
        weights and dS rounded to a half input's format before their
        matmuls, a backward that recomputes the weights from a stored
        logsumexp and reads the stored output for D, and gradients kept in
        the output format between blocks (PyTorch's CPU fused kernel for
        float16 and bfloat16).
    EFFICIENT_ATTENTION, CUDNN_ATTENTION
        As FLASH_ATTENTION, with the gradients accumulated in float32 to
        the end, as the GPU kernels do.
    TRITON_FLASH_ATTENTION
        The only member with no SDPBackend counterpart: FlashAttention-2
        kernels in the manner of Triton's fused-attention tutorial.  The
        forward is FLASH_ATTENTION's; the backward recomputes the weights
        with exp2 from the forward's logsumexp (its online softmax over
        blocks of 16 keys counted), from K * (scale / ln 2) (or Q * scale)
        rounded to the half format, which also multiplies dS, rounds dS to
        the half format (where it may overflow) and accumulates the
        gradients in float32 over blocks of 16.
    """

    MATH = (
        AttentionTolerance("math", kv_block=_CPU_KV_SPLIT),
        AttentionTolerance("math.backward", grad_query_block=_CPU_KV_SPLIT, grad_key_block=_CPU_Q_SPLIT),
    )
    FLASH_ATTENTION = (
        AttentionTolerance("flash_attention", kv_block=16, weights_in_input_format=True),
        AttentionTolerance("flash_attention.backward", weights_in_input_format=True, ds_in_input_format=True,
                           grad_query_block=_CPU_KV_SPLIT, grad_key_block=_CPU_Q_SPLIT,
                           blocks_in_output_format=True),
    )
    EFFICIENT_ATTENTION = (
        AttentionTolerance("efficient_attention", kv_block=16, weights_in_input_format=True),
        AttentionTolerance("efficient_attention.backward", weights_in_input_format=True,
                           ds_in_input_format=True, grad_query_block=16, grad_key_block=16),
    )
    CUDNN_ATTENTION = (
        AttentionTolerance("cudnn_attention", kv_block=16, weights_in_input_format=True),
        AttentionTolerance("cudnn_attention.backward", weights_in_input_format=True,
                           ds_in_input_format=True, grad_query_block=16, grad_key_block=16),
    )
    TRITON_FLASH_ATTENTION = (
        AttentionTolerance("triton_flash_attention", kv_block=16, weights_in_input_format=True),
        AttentionTolerance("triton_flash_attention.backward", kv_block=16, weights_in_input_format=True,
                           ds_in_input_format=True, grad_query_block=16, grad_key_block=16,
                           prescaled_operands_in_input_format=True),
    )

    @property
    def tolerance(self) -> AttentionTolerance:
        """The forward's algorithm class."""
        return self.value[0]

    @property
    def backward_tolerance(self) -> AttentionTolerance:
        """The backward's algorithm class."""
        return self.value[1]

    def __str__(self) -> str:
        return self.name


def _check_algorithm(algorithm: Any) -> AttentionAlgorithm:
    if isinstance(algorithm, AttentionAlgorithm):
        return algorithm
    if isinstance(algorithm, str) and algorithm.upper() in AttentionAlgorithm.__members__:
        return AttentionAlgorithm[algorithm.upper()]
    name = getattr(algorithm, "name", None)
    if type(algorithm).__name__ == "SDPBackend" and name in AttentionAlgorithm.__members__:
        return AttentionAlgorithm[name]
    raise TypeError(f"{OP}: algorithm={algorithm!r} is not an AttentionAlgorithm; use one of "
                    f"{', '.join('er.AttentionAlgorithm.' + m for m in AttentionAlgorithm.__members__)}")


def _check_budget(budget: Any) -> float:
    if isinstance(budget, bool) or not isinstance(budget, (int, float, np.integer, np.floating)):
        raise TypeError(f"{OP}: refine_budget={budget!r} must be a number of work units (one unit: about one "
                        f"64-bit Arb exp); the default is {DEFAULT_BUDGET:.0f}")
    if not budget >= 0:
        raise ValueError(f"{OP}: refine_budget={budget!r} must be a nonnegative number of work units "
                         f"(one unit: about one 64-bit Arb exp); the default is {DEFAULT_BUDGET:.0f}")
    return float(budget)


class _State:
    """One attention call: the problem, its first pass and its refiner, shared by forward and backward."""

    def __init__(self, pb: Problem, budget: float) -> None:
        self.pb = pb
        self.budget = budget
        self.special_out = None
        neg_inf_logit = None
        if pb.any_nonfinite:
            ieee = ieee_math_path(pb, None)
            neg_inf_logit = ieee["neg_inf_logit"]
            self.special_out = ieee["out"]
        # -inf logits mask their keys; under masked_rows="mean", rows with nothing to attend turn uniform.
        settle_masks(pb, neg_inf_logit)
        self.fp = FirstPass(pb)
        self._fwd_E: dict[AttentionTolerance, tuple[np.ndarray, np.ndarray]] = {}

    def forward_E(self, model: AttentionTolerance) -> tuple[np.ndarray, np.ndarray]:
        if model not in self._fwd_E:
            E, overflow, _ = forward_tolerance(self.fp, model, self.pb.fmt)
            self._fwd_E[model] = (E, overflow)
        return self._fwd_E[model]


def _decide(passes: Passes, which: str,
            enclosure: tuple[np.ndarray, np.ndarray, np.ndarray], fmt: Format, special: np.ndarray | None
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rounded values and float64 bounds x_lo <= exact <= x_hi, refining what the first pass leaves open.

    Elements whose normal answer is a special value are not refined: the special value replaces them.
    """
    rounded, ok, x_lo, x_hi = _rounded_and_bounds(*enclosure, fmt)
    if special is not None:
        ok = ok | (special.reshape(ok.shape) != 0)
    rounded, x_lo, x_hi = (a.reshape(-1).copy() for a in (rounded, x_lo, x_hi))
    pending = np.flatnonzero(~ok.reshape(-1))
    if pending.size:
        # Exact zeros (a row with one key, a zero row of dO, ...) need no recomputation.
        zero = passes[1].structural_zeros(which, pending)
        rounded[pending[zero]], x_lo[pending[zero]], x_hi[pending[zero]] = 0.0, 0.0, 0.0
        pending = pending[~zero]
    for later in passes[0]:
        if not pending.size:
            break
        # Each second pass encloses the elements still undecided again, more tightly (_passes).
        r2, ok2, lo_b, hi_b = _rounded_and_bounds(*later.enclose(which, pending), fmt, tight=True)
        done = pending[ok2]
        rounded[done], x_lo[done], x_hi[done] = r2[ok2], lo_b[ok2], hi_b[ok2]
        pending = pending[~ok2]
    for f, (r, lo, hi) in passes[1].refine(which, pending, fmt, presorted=True).items():
        rounded[f], x_lo[f], x_hi[f] = r, lo, hi
    return rounded, x_lo, x_hi


def _rounded_and_bounds(hi: np.ndarray, lo: np.ndarray, rad: np.ndarray, fmt: Format, *, tight: bool = False
                        ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The rounding of the enclosures hi + lo +- rad to ``fmt``, where it is decided, and float64
    bounds x_lo <= exact <= x_hi (a float64 step out for the midpoint's rounding, one for the radius's).

    ``tight`` decides from the enclosure's ends found by nextafter (a float64 ulp or two out), not
    by the cheaper relative slack of 2**-50 (about four): for the few elements a second pass
    encloses.  The seed-0 1x8x1024x64 float32 backward once sent a grad_key element whose longdouble
    enclosure cleared a float32 midpoint by 3e-18 (value 0.0045) to the double-double pass, 0.35-0.5 s
    for its head, only for that slack."""
    with np.errstate(invalid="ignore", over="ignore"):
        bounds = enclosure_bounds(hi, lo, rad, tight=True) if tight else None
        rounded, ok = decide(hi, lo, rad, fmt, bounds)
        mid = hi + lo
        return rounded, ok, next_down(next_down(mid) - rad), next_up(next_up(mid) + rad)


_FLASH_HINT = ("The output is covered under FLASH_ATTENTION, the class of PyTorch's CPU fused kernel for half "
               "formats: pass algorithm=er.AttentionAlgorithm.FLASH_ATTENTION if that kernel ran.")


class _MathResult(Result):
    """A MATH forward of half inputs: a failed check says whether FLASH_ATTENTION covers the output."""

    def __init__(self, *, flash: Callable[[], Result], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._flash = flash

    def check(self, x: Any, *, worst: int = 5) -> None:
        __tracebackhide__ = True
        try:
            super().check(x, worst=worst)
        except (OutOfToleranceError, SpecialValueError) as exc:
            with own_threads():  # computing the FLASH_ATTENTION forward is an op's work
                flash = self._flash()
            if not flash.covers(x).all():
                raise
            raise type(exc)(f"{exc}\n{_FLASH_HINT}", op=exc.op, indices=exc.indices, **exc.details) from None


def _result(st: _State, passes: Passes, which: str,
            enclosure: tuple[np.ndarray, np.ndarray, np.ndarray], E: np.ndarray, overflow: np.ndarray,
            special: np.ndarray | None, algorithm: AttentionAlgorithm, backward: Any = None,
            flash: Callable[[], Result] | None = None) -> Result:
    pb = st.pb
    fmt = pb.fmt
    shape = pb.out_shape if which == "out" else pb.shapes[which]
    rounded, x_lo, x_hi = _decide(passes, which, enclosure, fmt, special)
    part = judge(rounded, x_lo, x_hi, E.reshape(-1), fmt,
                 special=None if special is None else special.reshape(-1), overflow=overflow.reshape(-1))
    for name in ("rounded", "x_lo", "x_hi", "lo", "hi", "nan_ok", "special_ok", "tolerance"):
        setattr(part, name, np.asarray(getattr(part, name)).reshape(shape))
    refiner = passes[1]

    def exact(index: tuple[int, ...]) -> Any:
        return refiner.exact_value(which, int(np.ravel_multi_index(index, shape)))

    kind, extra = (Result, {}) if flash is None else (_MathResult, {"flash": flash})
    return kind(op=refiner.name(which), fmt=fmt, parts=[part], model=algorithm, exact=exact,
                backward=backward, no_backward=f"{refiner.name(which)} has no backward", **extra)


def _forward(st: _State, algorithm: AttentionAlgorithm) -> Result:
    fp = st.fp
    E, overflow = st.forward_E(algorithm.tolerance)

    def backward(grad: Any) -> Gradients:
        return _backward(st, grad, algorithm)

    passes = _passes(st.pb, fp, None, st.budget)
    flash = None
    if algorithm is AttentionAlgorithm.MATH and st.pb.fmt.name in ("float16", "bfloat16"):
        def flash() -> Result:
            return _forward(st, AttentionAlgorithm.FLASH_ATTENTION)
    return _result(st, passes, "out", (fp.O_hi, fp.O_lo, fp.rad_O), E, overflow, st.special_out, algorithm,
                   backward, flash)


def _backward(st: _State, grad: Any, algorithm: AttentionAlgorithm) -> Gradients:
    pb, fp = st.pb, st.fp
    G_out = read_grad(grad, pb.fmt, pb.out_shape, OP)
    G_raw = G_out.reshape(pb.H, pb.L, pb.Ev)
    specials = None
    if pb.any_nonfinite or not np.isfinite(G_raw).all():
        specials = ieee_math_path(pb, G_raw)
    G = np.where(np.isfinite(G_raw), G_raw, 0.0)
    groups: list[tuple[tuple[str, ...], np.ndarray, FirstPass]] = [(("query", "key", "value"), G, fp)]
    if pb.uniform is not None:
        # A uniform row's logits are constants, so its dS is 0: grad_query and grad_key are those of
        # an output gradient zero on its rows, while grad_value takes the whole one.  Each group gets
        # its own copy of the first pass, which keeps its backward's arrays.
        G_qk = np.where(pb.uniform[..., None], 0.0, G)
        groups = [(("query", "key"), G_qk, copy.copy(fp)), (("value",), G, copy.copy(fp))]
    E_fwd, _ = st.forward_E(algorithm.tolerance)
    results = {}
    for names, G_group, fp_group in groups:
        fp_group.backward(G_group)
        # Each backward gets its own passes: what they cache depends on the output gradient.
        passes = _passes(pb, fp_group, G_group, st.budget)
        for which in names:
            enclosure = fp_group.grad(which)
            E, overflow = backward_tolerance(fp_group, algorithm.backward_tolerance, pb.fmt, E_fwd, which)
            special = None if specials is None else specials["grad_" + which]
            results["grad_" + which] = _result(st, passes, which, enclosure, E, overflow, special, algorithm)
    absent = {"grad_attn_mask": "a float attn_mask gets no gradient (ExactRef's attention, like "
                                "PyTorch's fused kernels, treats the mask as a constant)"}
    return Gradients(f"{OP}.backward", results, absent)


def scaled_dot_product_attention(query: Any, key: Any, value: Any, attn_mask: Any = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                                 enable_gqa: bool = False, *, causal_alignment: str = "top_left",
                                 algorithm: AttentionAlgorithm = AttentionAlgorithm.MATH,
                                 refine_budget: float = DEFAULT_BUDGET, masked_rows: str = "zero",
                                 mask_nan: str = "propagate") -> Result:
    """The exact ``softmax(scale * query @ key^T + mask) @ value``, rounded once, as PyTorch's math path defines it.

    ``query`` is (..., L, E), ``key`` (..., S, E) and ``value`` (..., S, Ev),
    all in one real format; ``attn_mask`` is bool (attend where True) or a
    float format (added), broadcastable to (..., L, S).  ``causal_alignment``
    ("top_left" or "bottom_right") places the causal mask when
    ``is_causal=True``.  ``algorithm`` names the class of kernels the
    tolerance holds for.  ``refine_budget`` bounds the certified work spent
    on each output (forward, and each gradient of a backward), in units of
    one 64-bit Arb exp (a microsecond or two); an element still undecided
    when its next refinement would pass it raises ReferenceBudgetError.
    ``masked_rows`` and ``mask_nan`` choose PyTorch's masking semantics
    (the defaults, "zero" and "propagate") or JAX's ("mean" and "hide"):
    what a row with every key masked gives, and whether a NaN or infinite
    logit under the mask reaches its row (docs/attention.md, "Masking
    semantics").

    >>> import exactref as er
    >>> q = [[1.0, 0.0]]
    >>> er.scaled_dot_product_attention(q, [[1.0, 0.0], [1.0, 0.0]], [[1.0], [3.0]]).rounded.tolist()
    [[2.0]]
    """
    algorithm = _check_algorithm(algorithm)
    budget = _check_budget(refine_budget)
    pb = read_problem(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment,
                      masked_rows, mask_nan)
    return _forward(_State(pb, budget), algorithm)


def _standalone_backward(query: Any, key: Any, value: Any, grad: Any, attn_mask: Any = None,
                         dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                         enable_gqa: bool = False, *, causal_alignment: str = "top_left",
                         algorithm: AttentionAlgorithm = AttentionAlgorithm.MATH,
                         refine_budget: float = DEFAULT_BUDGET, masked_rows: str = "zero",
                         mask_nan: str = "propagate") -> Gradients:
    """grad_query, grad_key and grad_value of scaled_dot_product_attention for the output gradient ``grad``."""
    algorithm = _check_algorithm(algorithm)
    budget = _check_budget(refine_budget)
    pb = read_problem(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, causal_alignment,
                      masked_rows, mask_nan)
    return _backward(_State(pb, budget), grad, algorithm)


scaled_dot_product_attention = Op(OP, scaled_dot_product_attention, _standalone_backward)
