"""What every rational op shares: the op object, reading gradients, folding broadcast copies,
and turning per-part terms plus a tolerance into a Result."""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from .. import _fused, _fused_judge, _pool
from .._convert import (
    Operand,
    _plain,
    asarray,
    check_readable,
    convert,
    format_of_dtype,
)
from .._parallel import for_each_slice
from .._threads import own_threads, small
from ..engine.decision import decide_one
from ..engine.fast import Enclosure
from ..engine.products import NarrowProduct
from ..engine.sumprod import (
    Solution,
    Term,
    exact_fraction,
    plain_narrow_product,
    release_terms,
    solve,
    solve_in_blocks,
    specials,
)
from ..formats import ComplexFormat, Format, part_of
from ..models._error_model import ErrorModel
from ..result import Gradients, Part, Result, judge, judge_one
from ._flush import flushed, flushed_backward, wants_flush

__all__ = ["Op", "build", "check_bytes", "check_size", "fold_copies", "one_part", "read_grad"]

# E is multiplied by this so that second-order terms left out of the
# first-order formulas can never make a bound too small.
_SLACK = 1.0 + 2.0 ** -20


class Op:
    """An op: call it for the forward Result; ``.backward(...)`` for the Gradients."""

    def __init__(self, name: str, forward: Callable[..., Result],
                 backward: Callable[..., Gradients] | None = None, no_backward: str = "",
                 needs_limit: Callable[[tuple[Any, ...], dict[str, Any]], bool] | None = None) -> None:
        """``needs_limit(args, kwargs)``, where given, says whether a forward call that is not small takes
        the BLAS limit (exactref/_threads.py): False for one that calls no BLAS and runs on one thread."""
        self.__name__ = name
        self._forward = forward
        self._backward = backward
        self._no_backward = no_backward
        self._needs_limit = needs_limit
        functools.update_wrapper(self, forward)

    def __call__(self, *args: Any, **kwargs: Any) -> Result:
        # Bounds use inf and NaN on purpose (an overflowing bound means "no
        # bound"), so numpy's floating-point warnings are noise to the user.
        # One BLAS thread while the op runs: see exactref/_threads.py.
        tiny = _small_call(args, kwargs)
        limit = not tiny and (self._needs_limit is None or self._needs_limit(args, kwargs))
        with own_threads(limit=limit), np.errstate(all="ignore"):
            res = flushed(self._forward, args, kwargs) if wants_flush(kwargs) else self._forward(*args, **kwargs)
        if tiny and isinstance(res, Result):
            res._small = True  # its backward, for a small grad, needs no limit either
        return res

    @property
    def backward(self) -> Callable[..., Gradients]:
        if self._backward is None:
            raise AttributeError(self._no_backward or f"{self.__name__} has no backward")
        backward = self._backward

        @functools.wraps(backward)
        def quiet(*args: Any, **kwargs: Any) -> Gradients:
            with own_threads(limit=not _small_call(args, kwargs)), np.errstate(all="ignore"):
                if wants_flush(kwargs):
                    return flushed_backward(backward, args, kwargs)
                return backward(*args, **kwargs)
        return quiet

    def __repr__(self) -> str:
        return f"<exactref op {self.__name__}>"


def _small_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether an op's arguments are all small (exactref._threads.small), its error model aside."""
    return small(args) and small(v for v in kwargs.values() if not isinstance(v, ErrorModel))


def read_grad(grad: Any, fmt: Format | ComplexFormat, shape: tuple[int, ...], op: str) -> np.ndarray:
    """The output gradient as exact float64/complex128 values, checked against the output."""
    if grad is None:
        raise TypeError(f"{op}.backward needs grad, the gradient of the output; there is no default of ones")
    check_readable(grad, "grad")
    # (No copy of a tensor's values yet: the astype below makes the one copy.)
    arr = _plain(grad, copy=False) if not isinstance(grad, (list, tuple, int, float, complex)) else None
    if arr is None:
        arr = asarray(grad, fmt)
    else:
        arr = np.asarray(arr)
        if arr.dtype.kind not in "fc" and arr.dtype.name != "bfloat16":
            raise TypeError(f"grad has dtype {arr.dtype}; it must have {op}'s output format {fmt.name}")
        if format_of_dtype(arr.dtype, argument="grad's dtype") != fmt:
            raise TypeError(f"grad has dtype {arr.dtype.name} but {op}'s output has dtype {fmt.name}; "
                            f"convert it with er.asarray(grad, {fmt.name!r})")
    if arr.shape != shape:
        raise ValueError(f"grad has shape {arr.shape} but {op}'s output has shape {shape}")
    return np.asarray(arr).astype(np.complex128 if fmt.is_complex else np.float64)


def fold_copies(g: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Arrange ``g`` (the broadcast shape) so that the copies of each element of ``shape`` lie along a new last axis.

    Returns an array of ``shape + (copies,)``: summing its last axis is what
    PyTorch's ``sum_to_size`` computes for a broadcast operand.
    """
    full = g.shape
    lead = len(full) - len(shape)
    padded = (1,) * lead + tuple(shape)
    reduce_axes = [i for i, (n, m) in enumerate(zip(padded, full)) if n == 1 and m != 1]
    keep_axes = [i for i in range(len(full)) if i not in reduce_axes]
    moved = np.transpose(g, keep_axes + reduce_axes)
    copies = int(np.prod([full[i] for i in reduce_axes], dtype=np.int64)) if reduce_axes else 1
    return moved.reshape(tuple(shape) + (copies,))


def copies_of(shape: tuple[int, ...], full: tuple[int, ...]) -> int:
    """How many broadcast copies of each element of ``shape`` the shape ``full`` has."""
    return int(np.prod(full, dtype=np.int64)) // max(1, int(np.prod(shape, dtype=np.int64)))


def zero_nonfinite(x: np.ndarray) -> np.ndarray:
    """x with NaN and inf replaced by 0, part by part for complex values."""
    if np.isfinite(x).all():
        return x
    if np.iscomplexobj(x):
        out = np.empty(x.shape, dtype=x.dtype)
        out.real, out.imag = zero_nonfinite(x.real), zero_nonfinite(x.imag)
        return out
    return np.where(np.isfinite(x), x, 0.0)


def parts_of(x: np.ndarray, complex_: bool) -> tuple[np.ndarray, np.ndarray]:
    """Real and imaginary parts as float64 (zeros for a real array in a complex op)."""
    if np.iscomplexobj(x):
        return np.ascontiguousarray(x.real), np.ascontiguousarray(x.imag)
    return x, np.zeros_like(x)


def check_size(op: str, elements: int, what: str) -> None:
    """Refuse work whose float64 temporaries (about 12 per element) would not fit in this machine's memory."""
    check_bytes(op, elements * 8 * 12, what)


def check_bytes(op: str, need: int, what: str) -> None:
    """Refuse work that needs ``need`` bytes of working memory, more than half of this machine's."""
    have = _pool.physical_memory()
    if need > have // 2:
        raise ValueError(f"{op}: {what} needs about {need / 2**30:.1f} GiB of working memory, "
                         f"more than half of this machine's {have / 2**30:.1f} GiB; use smaller inputs")


@dataclass
class PartSpec:
    """How to compute one real part: its exact terms, its terms for special values, and its tolerance."""

    terms: list[Term]
    special_terms: list[Term] | None
    tolerance: Callable[[Solution], tuple[np.ndarray, np.ndarray | None]]
    # Whether ``tolerance`` is elementwise in the Solution: given a block of its rows, it gives that
    # block of the tolerance and overflow marks.  Then a large real output is judged block by block,
    # each right after it is solved (build).
    blockwise: bool = False


def build(op: str, fmt: Format | ComplexFormat, shape: tuple[int, ...], specs: list[PartSpec],
          model: ErrorModel, *, out_shape: tuple[int, ...] | None = None,
          backward: Callable[[Any], Gradients] | None = None,
          typical: Callable[[tuple[int, ...]], float] | None = None, via: Format | None = None,
          judged: list[Part] | None = None) -> Result:
    """Solve every part exactly, apply its tolerance and special values, and wrap it as a Result.

    The terms are computed in ``shape``; the Result has ``out_shape`` (the
    same elements in the same order), by default ``shape``.  ``typical``
    emulates one kernel of the model's order at an index of ``shape``; ``via`` is
    a format the result may be rounded to first (see :func:`exactref.result.judge`).
    ``judged``: the parts, already judged (:func:`one_part`), which are then not solved again.
    """
    out_shape = shape if out_shape is None else out_shape
    pfmt = part_of(fmt)
    solved = []
    # (An output of one judging block gains nothing: it keeps the steps' plain order, at less cost.)
    # One real part whose tolerance is elementwise, without special values: judged as it is solved.
    blockwise = len(specs) == 1 and specs[0].blockwise and specs[0].special_terms is None and via is None
    if judged is not None:
        parts, specs_left = list(judged), []
    elif blockwise and (small := _judged_at_once(specs[0], shape, pfmt)) is not None:
        parts, specs_left = [small], []
    elif blockwise and math.prod(shape) > _JUDGE_BLOCK:
        parts = [_solve_judged(specs[0], shape, pfmt)]
        specs_left: list[PartSpec] = []
    else:
        parts, specs_left = [], specs
    for ps in specs_left:
        sol = solve(ps.terms, shape, pfmt)
        E, overflow = _tolerance_of(ps, sol)  # slackened block by block, in _judge
        special = specials(ps.special_terms, shape) if ps.special_terms is not None else None
        # The last: where NaN is accepted besides the answer.
        solved.append((sol, E, overflow, special, None))
    if len(solved) == 2:
        _share_complex_specials(solved)
    for sol, E, overflow, special, nan_also in solved:
        part = _judge(sol, E, pfmt, special, overflow, nan_also, via)
        if nan_also is not None and overflow is not None:
            # A finite product that overflows meeting an infinity gives inf or NaN by the order of
            # the complex formula's operations (a BLAS may scale by alpha first): either may come.
            part.special_ok = part.special_ok | np.asarray(nan_also & overflow)
        parts.append(part)
    for part in parts:
        for name in ("rounded", "x_lo", "x_hi", "lo", "hi", "nan_ok", "special_ok", "tolerance"):
            value = getattr(part, name)
            if type(value) is not np.ndarray or value.shape != out_shape:  # usually it is already
                setattr(part, name, np.asarray(value).reshape(out_shape))

    def exact(index: tuple[int, ...]) -> Fraction | tuple[Fraction, Fraction]:
        flat = int(np.ravel_multi_index(index, out_shape)) if out_shape else 0
        values = tuple(exact_fraction(ps.terms, shape, flat) for ps in specs)
        return values[0] if len(values) == 1 else values

    def typical_at(index: tuple[int, ...]) -> float:
        flat = int(np.ravel_multi_index(index, out_shape)) if out_shape else 0
        return typical(tuple(int(i) for i in np.unravel_index(flat, shape)) if shape else ())

    return Result(op=op, fmt=fmt, parts=parts, model=model, exact=exact, backward=backward,
                  typical=typical_at if typical is not None else None)


def one_part(enc: Enclosure, fmt: Format, bound: Callable[[float], tuple[float, bool]]) -> Part | None:
    """The Part that :func:`build` gives a real part of one element without special values, from its
    enclosure ``enc`` (of that one element) and ``bound(S)``, its tolerance before the slack and
    its overflow mark from its bound S on the sum of |terms| (what its PartSpec's tolerance makes
    of a Solution's S): decided, given its tolerance and judged on Python floats, by
    engine.decision.decide_one and result.judge_one (the same values as solve, _tolerance_of and
    _judge, bit for bit).  None where those do not cover it (undecided, an overflow possible, a
    format other than float32...): build's own steps then make it.

    Why: a long full sum's one output (ops/reduction.py) pays the numpy calls' fixed costs of
    those steps after its loop has run through megabytes, with the caches cold.  At 10**6 float32
    values, each sum right after torch's, one_part on and off in turn in one process (medians of
    301 pairs, three runs): 0.20-0.29 ms a call against 0.24-0.38 ms; at 2**16 values, 57
    against 98 us."""
    decided = decide_one(float(enc.hi), float(enc.lo), float(enc.rad), fmt)
    if decided is None:
        return None
    rounded, x_lo, x_hi = decided
    E, overflow = bound(float(enc.S))
    if overflow:
        return None
    # _slackened(E): for E > 0 and finite, E * _SLACK (judge_one declines the rest).
    ends = judge_one(x_lo, x_hi, float(E) * _SLACK, fmt) if E > 0 else None
    if ends is None:
        return None
    lo, hi, tol = ends
    floats = (np.array(v, dtype=np.float64) for v in (rounded, x_lo, x_hi, lo, hi))
    return Part(*floats, np.array(False), np.array(False), np.array(tol, dtype=np.float64))


def _judged_at_once(ps: PartSpec, shape: tuple[int, ...], fmt: Format) -> Part | None:
    """The Part of a real output of fewer than _fused.MIN_SIZE elements whose one term is a plain
    narrow product (a float32 matmul's, or a gradient's), whose tolerance is the bound for any
    order alone, and without special values: decided, given its tolerance and judged from its BLAS
    products in one call of exactref/_fused_judge.py's loop, the one that judges a large output's
    blocks (_solve_judged), with the same values as the numpy steps, bit for bit.  None where that
    does not apply, or where an element is left undecided (the exact path's, as the numpy steps
    take it) or its bits to the numpy code: build's steps then make the Part.

    Why: a small output pays each numpy call's fixed cost, about thirty of them from the products
    to the judgement.  Small float32 matmuls (sides 1 to 8, forward, backward and covers:
    benchmarks/bench_matmul.py's cases) took 254 us a case against 398 (medians of ten rounds of
    their 200 cases, in turn in one process).  Such ops now load numba, once per process.  Not
    past MIN_SIZE, where the compiled loops take over anyway: there an output usually has an
    undecided element or two (a standard normal float32 512**3 product left 17 to 32 of each block
    of 131072), and making the products twice cost a float32 256**3 matmul 4.95 ms against 3.55.
    """
    bound = getattr(ps.tolerance, "scaled_bound", None)
    if bound is None or math.prod(shape) >= _fused.MIN_SIZE:
        return None
    product = plain_narrow_product(ps.terms)
    if product is None:
        return None
    out = {name: np.empty(shape, dtype) for name, dtype in _PART_DTYPES.items()}
    made = _fused_judge.decide_and_judge(fmt, product, bound, out, small=True)
    if made is None or not made[1].all():
        return None  # (build's steps use the B it prepared, and then drop it)
    release_terms(ps.terms)  # as solve does: the Result keeps its terms, not B's slices or magnitudes
    return Part(**out)


def _solve_judged(ps: PartSpec, shape: tuple[int, ...], fmt: Format) -> Part:
    """The Part of a real output without special values whose tolerance is elementwise
    (``ps.blockwise``): each block of rows solved, given its tolerance and judged on the thread
    that solved it, right after it.

    The values are those of solving the whole output, then computing the tolerance, then judging
    (each step is elementwise), bit for bit; but the whole output's sums of |terms| and tolerance
    before the slack are never made, nor read back from memory by the next step, and the three
    steps share one handing out of blocks to the threads.  Run alone, a float32 or float16
    1024**3 matmul took 13 to 20% less time so (minima of alternating runs), and at 2048**3 0 to
    4%; right after torch's own matmul, as benchmarks/bench_matmul.py runs them, 1024**3 showed
    no difference and 2048**3 2 to 8%.
    """
    # The output's arrays are made by the first block to need them (once its products are made),
    # not before the blocks start:
    # made first, a float32 or float16 1024**3 matmul took 70-85 ms against 62-66 (minima of four
    # alternating pairs, that version run second in each, which alone costs a few ms here).
    out: dict[str, np.ndarray] = {}
    lock = threading.Lock()
    whole: list[Part] = []  # the Part itself, where the output is one block (a single long row)

    def arrays() -> dict[str, np.ndarray]:
        with lock:
            if not out:
                # (Large arrays come from the buffers of results no longer used: exactref/_pool.py.)
                out.update((name, _pool.empty(shape, dtype)) for name, dtype in _PART_DTYPES.items())
        return out

    def into(cut: tuple[slice, ...]) -> tuple[np.ndarray, ...] | None:
        # A block's rounded values and bounds are decided straight into the Part's arrays, which
        # judging it then need not copy (a float32 512**3 matmul's two threads took 0.3 ms each
        # for those copies, of 0.5 ms judging).  Where its place is not contiguous (a batch's
        # rows), it decides into arrays of its own.
        views = tuple(arrays()[name][cut] for name in ("rounded", "x_lo", "x_hi"))
        return views if views[0].flags.c_contiguous else None

    # Where the tolerance is the bound for any order alone (ops/matmul.py), a narrow product's block
    # is decided, given its tolerance and judged in one compiled pass from its BLAS products
    # (exactref/_fused_judge.py).
    bound = getattr(ps.tolerance, "scaled_bound", None)

    def decide(product: NarrowProduct, cut: tuple[slice, ...]) -> tuple[np.ndarray, ...] | None:
        return _fused_judge.decide_and_judge(fmt, product, bound, {name: a[cut] for name, a in arrays().items()})

    def finish(sol: Solution, cut: tuple[slice, ...] | None) -> None:
        if sol.judged is not None and cut is not None:
            _judge_rest(ps, sol, fmt, bound, {name: a[cut] for name, a in arrays().items()})
            return
        E, overflow = _tolerance_of(ps, sol)
        if cut is None:
            whole.append(_judge(sol, E, fmt, None, overflow, None))
            return
        _judge(sol, E, fmt, None, overflow, None, into=(arrays(), cut))
    # (Without the constants, the engine's blocks enclose and decide as they did: no decide at all.)
    solve_in_blocks(ps.terms, shape, fmt, finish, into, None if bound is None else decide)
    return whole[0] if whole else Part(**out)


def _judge_rest(ps: PartSpec, sol: Solution, fmt: Format, bound: tuple[float, float, float, float],
                fields: dict[str, np.ndarray]) -> None:
    """Judge the elements of a block that its one-pass decision did not (``sol.judged`` False: the
    exact path rounded them, or their bits were left to the numpy code) into ``fields``, the
    block's views of the Part's arrays: by the same compiled steps, and any they leave by
    result.judge.  Judging is elementwise: these elements get the values that judging the whole
    block would give them."""
    idx = np.flatnonzero(~sol.judged)
    if idx.size:
        idx = _fused_judge.judge_again(fmt, idx, sol.S, bound, fields)
    if not idx.size:
        return
    sub = Solution(*(a.reshape(-1)[idx] for a in (sol.rounded, sol.x_lo, sol.x_hi, sol.S)), 0)
    E, overflow = _tolerance_of(ps, sub)
    with np.errstate(invalid="ignore", over="ignore"):
        part = judge(sub.rounded, sub.x_lo, sub.x_hi, _slackened(E), fmt, overflow=overflow)
    for name in _PART_DTYPES:
        # (The views are C-contiguous, as decide_and_judge required: reshape gives views.)
        fields[name].reshape(-1)[idx] = getattr(part, name)


def _tolerance_of(ps: PartSpec, sol: Solution) -> tuple[np.ndarray, np.ndarray | None]:
    """``ps.tolerance(sol)``: the tolerance before its slack, and the overflow marks."""
    with np.errstate(over="ignore", invalid="ignore"):
        # Overflowing bound arithmetic yields inf, which means "no bound".
        return ps.tolerance(sol)


# Elements judged at a time: the judgement's float64 temporaries stay near 1 MiB each.
_JUDGE_BLOCK = 1 << 17


def _judge(sol: Solution, E: np.ndarray, fmt: Format, special: np.ndarray | None,
           overflow: np.ndarray | None, nan_also: np.ndarray | None, via: Format | None = None, *,
           into: tuple[dict[str, np.ndarray], tuple[slice, ...]] | None = None) -> Part:
    """:func:`judge`, a block of leading-axis rows at a time for a large output (it is elementwise).

    The Part's rounded value and bounds are written over the Solution's own
    arrays, which nothing else holds, so that only the acceptance interval
    and the tolerance are new.  With ``into=(arrays, at)``, the Solution is the
    block ``at`` of a larger output: each block's judgement is written into
    ``arrays`` (the larger output's, by field name) where it belongs, and they
    are returned as a Part.
    """
    shape = sol.rounded.shape
    size = math.prod(shape)  # (np.prod of a tuple costs several microseconds)
    if into is None and (not shape or size <= _JUDGE_BLOCK):
        return judge(sol.rounded, sol.x_lo, sol.x_hi, _slackened(E), fmt, special=special, overflow=overflow,
                     nan_also=nan_also, via=via)
    step = max(1, _JUDGE_BLOCK // max(size // shape[0], 1))
    full = [None if v is None else np.broadcast_to(v, shape) for v in (E, special, overflow, nan_also)]
    if into is None:
        out: dict[str, np.ndarray] = {"rounded": sol.rounded, "x_lo": sol.x_lo, "x_hi": sol.x_hi}
        # A Part's values and bounds are float64, its marks bool: the arrays exist before any block runs.
        for name, dtype in _PART_DTYPES.items():
            out.setdefault(name, np.empty(shape, dtype=dtype))
    else:
        out = into[0]

    fusable = special is None and nan_also is None and via is None and _fused.judges(fmt)

    def block(cut: slice) -> None:
        E_b, special_b, overflow_b, nan_b = (None if v is None else v[cut] for v in full)
        place = cut if into is None else _within(into[1], cut, shape[0])
        if fusable and _fused.judge_into(fmt, E_b, sol.x_lo[cut], sol.x_hi[cut], sol.rounded[cut], overflow_b,
                                         out, place):
            return  # (the same values, by one compiled loop: exactref/_fused.py)
        part = judge(sol.rounded[cut], sol.x_lo[cut], sol.x_hi[cut], _slackened(E_b), fmt, special=special_b,
                     overflow=overflow_b, nan_also=nan_b, via=via)
        for name in _PART_DTYPES:
            out[name][place] = getattr(part, name)
    for_each_slice(block, shape[0], step)  # side by side (exactref/_parallel.py)
    return Part(**out)


def _within(at: tuple[slice, ...], cut: slice, count: int) -> tuple[slice, ...]:
    """Where rows ``cut`` of the leading axis (of ``count``) of the block ``at`` of an output lie in it.

    The block is a slice of one axis (exactref/engine/sumprod.py), the others whole: a cut of the
    leading axis falls inside that slice if it is the leading axis, or replaces the whole leading one.
    """
    lead = at[0]
    if lead == slice(None):
        return (cut,) + at[1:]
    start = lead.start or 0
    return (slice(start + cut.start, start + min(cut.stop, count)),) + at[1:]


def _slackened(E: np.ndarray) -> np.ndarray:
    """The tolerance E with its slack (_SLACK) on each positive bound.

    A bound that overflowed (inf * 0 in a formula) means no bound at all: NaN
    becomes inf, which fmin gives (it passes over a NaN), with one numpy call
    fewer than np.isnan and a second np.where.
    """
    with np.errstate(over="ignore", invalid="ignore"):
        return np.where(E <= 0, E, np.fmin(E * _SLACK, np.inf))


_PART_DTYPES = {"rounded": np.float64, "x_lo": np.float64, "x_hi": np.float64, "lo": np.float64,
                "hi": np.float64, "nan_ok": np.bool_, "special_ok": np.bool_, "tolerance": np.float64}


def _share_complex_specials(solved: list) -> None:
    """Let an infinity in one part of a complex element excuse a NaN in the other.

    Complex kernels differ in how an inf (or an overflowing product) in one
    part spreads: the naive formula keeps the other part finite, BLAS
    kernels often turn it into NaN.  So where either part may overflow, both
    do; and where either part's evaluation meets an infinity, NaN is
    accepted in both (see docs/special-values.md).
    """
    (_, _, o0, sp0, _), (_, _, o1, sp1, _) = solved
    overflow = None if o0 is None and o1 is None else (
        (o0 if o0 is not None else False) | (o1 if o1 is not None else False))
    met_inf = None
    if sp0 is not None or sp1 is not None:
        met_inf = ((sp0 != 0) if sp0 is not None else False) | ((sp1 != 0) if sp1 is not None else False)
    for k, (sol, E, _, sp, _) in enumerate(solved):
        solved[k] = (sol, E, overflow, sp, met_inf)


def convert_operand(o: Operand, fmt: Format | ComplexFormat) -> Operand:
    return Operand(o.name, convert(o.array, fmt), fmt, o.tier, o.scalar)
