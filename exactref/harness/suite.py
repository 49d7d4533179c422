"""The built-in property suite: for each kernel, op, format and direction, a Hypothesis search for a mismatch.

Shared by the pytest plugin (one test item per cell) and ``exactref audit``
(one table row per cell).  A cell draws its cases from the strategy that the
``strategies`` registry hands out for the op (a kernel repository's own, when
it registered one), judges the kernel on each with :func:`exactref.harness.judge.judge`,
and steers the search with ``hypothesis.target`` toward the worst
error/tolerance ratio, so that near misses are pushed over the line.
"""

from __future__ import annotations

import json
import math
import time
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, given, reject, seed, settings, target
from hypothesis.errors import FailedHealthCheck, Unsatisfiable

from ..errors import ReferenceUnavailableError
from .judge import BaseExceptionGroup, first_line, is_keyed

# Under this name: the test body in run_cell uses it, and Hypothesis derives a derandomized
# run's seed from that body's source, on which docs/plugin.md's printed example depends.
from .judge import flatten as _flatten
from .judge import judge as judge_case
from .kernels import Kernel, KernelTimeoutError, kernel_formats

__all__ = ["Cell", "CellRun", "cells", "no_longer_fails", "run_cell", "strategy_source",
           "suite_case"]

TARGET_LABEL = "worst error/tolerance ratio"
# hypothesis.target needs a finite score.
_TARGET_CAP = 1e300


@dataclass(frozen=True, eq=False)
class Cell:
    """One op of one kernel, in one format and one direction."""

    kernel: Kernel
    fmt: str
    direction: str

    @property
    def op(self) -> str:
        return self.kernel.op

    @property
    def name(self) -> str:
        """The cell's name, which is also its pytest test id: ``matmul[float16-backward]``."""
        return f"{self.op}[{self.fmt}-{self.direction}]"

    @property
    def known_failure(self) -> str | None:
        entry = self.kernel.known_failure(self.fmt, self.direction)
        return None if entry is None else entry[1]


def cells(kernels: Mapping[str, Kernel], *, ops: Iterable[str] | None = None,
          formats: Iterable[str] | None = None) -> list[Cell]:
    """Every cell of ``kernels``, optionally only some ops and formats, in a stable order."""
    wanted_ops = None if ops is None else set(ops)
    wanted_formats = None if formats is None else tuple(formats)
    return [Cell(kernel, fmt, direction) for op, kernel in kernels.items()
            if wanted_ops is None or op in wanted_ops
            for fmt in kernel_formats(kernel, wanted_formats) for direction in kernel.directions_of(fmt)]


@dataclass
class CellRun:
    """What searching one cell found."""

    cell: Cell
    strategy: str = ""
    examples: int = 0
    unavailable: int = 0
    ratios: list[float] = field(default_factory=list)
    # err/typical at each example's worst element, for models that declare an order.
    typical: list[float] = field(default_factory=list)
    failures: list[BaseException] = field(default_factory=list)
    error: BaseException | None = None
    skipped: str = ""
    seconds: float = 0.0
    cut_short: bool = False
    # Ctrl-C stopped the search of this cell (exactref audit keeps what it had).
    interrupted: bool = False

    @property
    def worst(self) -> float:
        return max(self.ratios, default=0.0)

    @property
    def passed(self) -> bool:
        return not self.failures and self.error is None


def strategy_source(op: str) -> str:
    """Where the op's cases come from: a registered strategy's source, or the built-in factory."""
    import strategies as sx

    return sx.registered().get(op, f"strategies.{op}_inputs")


def cell_strategy(cell: Cell) -> Any:
    """The cell's strategy: the registered or built-in one, asked for the cell's format.

    A registered strategy *object* takes no options, so its cases are
    filtered to the cell's format instead.
    """
    import strategies as sx

    options = {"dtypes": [cell.fmt], **cell.kernel.strategy_options}
    try:
        return sx.strategy_for(cell.op, **options)
    except TypeError as first:
        typo = _unknown_options(cell)
        if typo is not None:
            raise typo from None
        if cell.op not in sx.registered():
            raise
        try:
            plain = sx.strategy_for(cell.op)
        except TypeError:
            raise first from None
        return plain.filter(lambda case: case.format.name == cell.fmt)


def _unknown_options(cell: Cell) -> TypeError | None:
    """The error naming the kernel's strategy_options that its strategy factory does not take, if any."""
    import inspect

    from strategies import registry

    factory = registry._REGISTRY.get(cell.op, (registry.BUILTIN[cell.op],))[0]
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    valid = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "dtypes"]
    unknown = [k for k in cell.kernel.strategy_options if k not in valid]
    if not unknown:
        return None
    module = cell.kernel.source.rsplit(":", 1)[0]
    return TypeError(f"{module}.EXACTREF_KERNELS[{cell.op!r}]['strategy_options'] has unknown "
                     f"key{'s' * (len(unknown) > 1)} {', '.join(map(repr, unknown))}; the strategy factory "
                     f"{strategy_source(cell.op)} takes {', '.join(valid) or 'none'} ('dtypes' is set per format)")


class _OutOfTime(BaseException):
    """Ends a cell's Hypothesis run; a BaseException, so that Hypothesis does not take it for a failure."""


class _Hung(BaseException):
    """A kernel call ran past its timeout: the search ends there, unshrunk, since every further call
    might cost the timeout again.  A BaseException, so that Hypothesis does not shrink it."""

    def __init__(self, failure: KernelTimeoutError) -> None:
        super().__init__(str(failure))
        self.failure = failure


def _size(case: Any) -> tuple[int, int]:
    """How big a case is, for keeping the smallest failing case of a run cut short."""
    from .cases import encode_case

    arrays = [v for v in (*case.inputs.values(), *case.kwargs.values(), case.grad) if hasattr(v, "size")]
    return sum(int(a.size) for a in arrays), len(json.dumps(encode_case(case.op, case.inputs, case.kwargs,
                                                                         case.grad)))


def _origin(exc: BaseException) -> tuple[Any, ...]:
    # The keyed failure types already say kind and place; other errors are told apart by text.
    if isinstance(exc, BaseExceptionGroup):
        return tuple(t for e in exc.exceptions for t in _origin(e))
    return (type(exc),) if is_keyed(exc) else (type(exc), str(exc).split("\n", 1)[0])


def _distinct(failures: list[BaseException]) -> list[BaseException]:
    """One failure per kind and place, the one with the smallest case: a group's members may repeat
    a failure also found alone."""
    best: dict[tuple[Any, ...], BaseException] = {}
    for exc in failures:
        key = _origin(exc)
        case = getattr(exc, "_exactref_case", None)
        old = best.get(key)
        if old is None or (case is not None and getattr(old, "_exactref_case", None) is not None
                           and _size(case) < _size(old._exactref_case)):  # type: ignore[attr-defined]
            best[key] = exc
    return list(best.values())


def run_cell(cell: Cell, *, base: settings, examples: int | None = None, device: str = "cpu",
             seed_value: int | None = None, database_key: str | None = None,
             shrink_seconds: float | None = None, on_example: Callable[[], None] | None = None,
             timeout: float | None = None) -> CellRun:
    """Search one cell; return what was found (failures are returned, not raised).

    ``base`` holds the Hypothesis settings to start from (the profile in
    pytest, quiet and database-free in the audit); ``seed_value`` makes the
    search reproducible; ``database_key`` keeps each cell's saved examples
    apart in Hypothesis's database.

    ``shrink_seconds`` bounds the time spent after the first failure.  Once a
    failure is found, Hypothesis goes on looking for other failures and
    shrinks each one; for large cases (attention, whose cases take ~20 ms to
    draw) that can take minutes.  When the time is up the run is cut short
    and each failure is reported with the smallest case seen for it.

    ``timeout`` bounds each kernel call (None: no limit); a call that runs
    past it ends the search, and is the cell's one failure.
    """
    run = CellRun(cell, strategy=strategy_source(cell.op))
    note = f"Examples drawn by {run.strategy}."
    start = time.perf_counter()
    try:
        strategy = cell_strategy(cell)
    except Exception as exc:  # a strategy that cannot be built is this cell's error, with its message
        run.error = exc
        run.seconds = time.perf_counter() - start
        return run

    found_at: list[float] = []
    smallest: dict[tuple[Any, ...], tuple[tuple[int, int], BaseException]] = {}
    hung: list[Any] = []

    # Named judge for body's sake: Hypothesis derives a derandomized run's seed from body's source.
    def judge(kernel: Kernel, direction: str, inputs: Any, kwargs: Any, grad: Any, **options: Any) -> Any:
        try:
            return judge_case(kernel, direction, inputs, kwargs, grad, timeout=timeout, **options)
        except KernelTimeoutError as exc:
            hung.append(exc)
            raise _Hung(exc) from None

    def body(case: Any) -> None:
        case = case.to_numpy()
        if found_at and shrink_seconds is not None and time.perf_counter() - found_at[0] > shrink_seconds:
            raise _OutOfTime
        try:
            verdict = judge(cell.kernel, cell.direction, case.inputs, case.kwargs, case.grad, device=device,
                            note=note)
        except ReferenceUnavailableError:
            run.unavailable += 1
            reject()
        except Exception as exc:
            # Attached so that the plugin can save the minimal case Hypothesis ends with.
            for each in _flatten(exc):
                each._exactref_case = case  # type: ignore[attr-defined]
            partial = getattr(exc, "verdict", None)
            if partial is not None:
                run.ratios.append(partial.worst)
                if partial.worst_typical is not None:
                    run.typical.append(partial.worst_typical)
            if not found_at:
                found_at.append(time.perf_counter())
            if shrink_seconds is not None:
                size, key = _size(case), _origin(exc)
                if key not in smallest or size < smallest[key][0]:
                    smallest[key] = (size, exc)
            raise
        if not found_at:
            # Examples run after the first failure are not counted: they are variations of it.
            run.examples += 1
            if on_example is not None:
                on_example()
        run.ratios.append(verdict.worst)
        if verdict.worst_typical is not None:
            run.typical.append(verdict.worst_typical)
        if math.isfinite(verdict.worst):
            target(min(verdict.worst, _TARGET_CAP), label=TARGET_LABEL)

    if database_key is not None:
        # Hypothesis keys its database by the test function; every cell shares this one.
        body._hypothesis_internal_add_digest = database_key.encode()  # type: ignore[attr-defined]
    # No explain phase: the lines it would point at are exactref's own, not the kernel's.
    phases = [p for p in base.phases if p != Phase.explain]
    chosen = settings(base, max_examples=examples if examples is not None else base.max_examples,
                      deadline=None, report_multiple_bugs=True, phases=phases,
                      suppress_health_check=list(HealthCheck))
    test = settings(chosen)(given(strategy)(body))
    if seed_value is not None:
        test = seed(zlib.crc32(cell.name.encode()) ^ seed_value)(test)
    try:
        test()
    except _Hung:
        run.failures = hung[:1]
    except _OutOfTime:
        _cut_short(run, smallest)
    except Unsatisfiable:
        run.skipped = (f"{run.strategy} drew no {cell.op} cases in {cell.fmt} that exactref could judge "
                       f"({run.unavailable} had no decidable reference)")
    except FailedHealthCheck as exc:
        run.error = exc
    except BaseException as exc:  # every failure Hypothesis reports is the cell's result
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        members = _flatten(exc)
        if any(isinstance(e, _OutOfTime) for e in members):
            # Hypothesis reported the time running out beside other failures, in one group: it is
            # the end of the search, not a failure.
            _cut_short(run, smallest)
        else:
            run.failures = _distinct(members)
    run.seconds = time.perf_counter() - start
    return run


def _cut_short(run: CellRun, smallest: dict[tuple[Any, ...], tuple[tuple[int, int], BaseException]]) -> None:
    """A search the time budget ended: each failure is reported by the smallest case seen for it."""
    run.failures = _distinct([e for _, exc in smallest.values() for e in _flatten(exc)])
    run.cut_short = True


def no_longer_fails(run: CellRun) -> str:
    """What to say of a run whose cell is a known failure but which passed; empty otherwise."""
    cell = run.cell
    if not cell.known_failure or not run.passed or run.skipped or not run.examples:
        return ""
    module = cell.kernel.source.rsplit(":", 1)[0]
    key = cell.kernel.known_failure(cell.fmt, cell.direction)[0]  # type: ignore[index]
    return (f"{cell.name}: known failure no longer fails: remove the entry {key!r} from "
            f"{module}.EXACTREF_KERNELS[{cell.op!r}]['known_failures'] (its reason: {cell.known_failure})")


def audit_settings() -> settings:
    """Quiet, database-free settings: the audit prints its own report."""
    return settings(database=None, verbosity=Verbosity.quiet, derandomize=False, print_blob=False)


def suite_case(run: CellRun, exc: BaseException, *, test: str, kernels: str) -> dict[str, Any] | None:
    """The regression-case content of one failure of a cell's run, or None when the failure is not a
    mismatch of the kernel (and so has no case to replay).  ``kernels`` names the kernel module."""
    from .cases import suite_content

    case = getattr(exc, "_exactref_case", None)
    if case is None or not is_keyed(exc):
        return None
    cell = run.cell
    return suite_content(test=test, kernel=f"{kernels}:{cell.op}", strategy=run.strategy, op=cell.op,
                         direction=cell.direction, fmt=cell.fmt, inputs=case.inputs, kwargs=case.kwargs,
                         grad=case.grad, model=str(cell.kernel.model(cell.direction, cell.fmt) or "default"),
                         failure=first_line(exc))
