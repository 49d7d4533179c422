"""The ``exactref`` command: ``exactref audit`` and ``exactref to-pytest``.

``exactref audit`` runs the built-in property suite against a kernel module
(PyTorch's own kernels unless configured otherwise), shows a progress bar,
then a table, then the minimal counterexamples, and exits 1 on any mismatch.
``exactref to-pytest CASE`` turns a saved regression case into a standalone
pytest file.  See ``docs/audit.md``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

__all__ = ["main"]

DEFAULT_KERNELS = "exactref.backends.torch"
#: The libraries whose kernels ship as kernel modules, exactref.backends.<name> (--backend NAME).
BACKENDS = ("torch", "numpy", "scipy", "jax")
#: Examples per cell when neither --examples nor [tool.exactref] examples says otherwise.
DEFAULT_EXAMPLES = 100
#: Seconds a cell may spend after its first failure looking for others and shrinking.
SHRINK_SECONDS = 20.0
EXIT_OK, EXIT_MISMATCH, EXIT_USAGE = 0, 1, 2
#: The shell's status for a command stopped by Ctrl-C (128 + SIGINT).
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """A bad flag or configuration; printed without a traceback, exit status 2."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="exactref", description="Exact references for numerical kernels.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    audit = sub.add_parser("audit", help="run the built-in property suite against a kernel module",
                           description="Run the built-in property suite against a kernel module: every op it "
                                       "provides, every format, forward and backward. Without --kernels or "
                                       "[tool.exactref] kernels, PyTorch's own kernels.")
    audit.add_argument("--ops", metavar="OPS", help="comma-separated ops (default: every op the kernels have)")
    audit.add_argument("--dtypes", metavar="DTYPES", help="comma-separated formats (default: every one)")
    audit.add_argument("--examples", metavar="N", type=int, help=f"examples per op, format and direction "
                                                                 f"(default {DEFAULT_EXAMPLES})")
    audit.add_argument("--kernels", metavar="MODULE", help=f"the kernel module (default: {DEFAULT_KERNELS}, "
                                                           "PyTorch's own)")
    audit.add_argument("--backend", metavar="NAME", help=f"a library's own kernels: {', '.join(BACKENDS)} "
                                                         "(the module exactref.backends.NAME)")
    audit.add_argument("--strategies", metavar="MODULE", help="a module that registers strategies per op")
    audit.add_argument("--device", metavar="DEVICE", help="the torch device the kernels run on (default cpu)")
    audit.add_argument("--seed", metavar="N", type=int, help="seed of the search; the same seed repeats a run")
    audit.add_argument("--report", metavar="FILE", type=Path,
                       help="also write a report with plots: FILE.md (Markdown) or FILE.html (needs matplotlib)")
    audit.add_argument("--regressions", metavar="DIR", type=Path,
                       help="replay the saved cases there first, and save each minimal failing case there, as "
                            "the pytest plugin does (default: [tool.exactref] regressions, for its kernels)")
    audit.add_argument("--timeout", metavar="SECONDS", help="seconds one kernel call may take before it is a "
                                                            "failure (default: [tool.exactref] timeout, or 60; "
                                                            "0: no limit)")
    case = sub.add_parser("to-pytest", help="turn a regression case into a standalone pytest file",
                          description="Turn a regression case file into a pytest file that replays it without "
                                      "Hypothesis.")
    case.add_argument("case", metavar="CASE", type=Path, help="the regression case file (.json)")
    case.add_argument("-o", "--output", metavar="FILE", type=Path, help="where to write it (default: stdout)")
    case.add_argument("--kernels", metavar="MODULE", help="the kernel module, instead of the one the case names")
    parser.set_defaults(commands={"audit": audit, "to-pytest": case})
    return parser


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """The arguments; an unknown option is reported with its subcommand's usage (exit status 2)."""
    args, extra = _parser().parse_known_args(argv)
    if extra:
        args.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the command; return the exit status (0 ok, 1 mismatches, 2 usage or configuration errors)."""
    args = _parse(argv)
    try:
        if args.command == "audit":
            return audit(args, sys.stdout, sys.stderr)
        return to_pytest(args, sys.stdout)
    except UsageError as exc:
        print(f"exactref {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


# ---------------------------------------------------------------- to-pytest


def check_output_path(path: Path, flag: str) -> None:
    """Raise a :class:`UsageError` unless ``path`` can be written.

    Called before any work, so that a bad path costs nothing: the directories
    it needs need not exist yet, but the nearest one that does must take a file.
    """
    fix = f"pass {flag} a file in a writable directory"
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a directory; {fix}")
    existing = next(p for p in path.parents if p.exists())
    if not existing.is_dir():
        raise UsageError(f"{flag} {path}: {existing} is a file, not a directory; {fix}")
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".exactref-probe-")
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot write into {existing} ({exc.strerror or exc}); {fix}") from None
    os.close(fd)
    os.unlink(probe)


def to_pytest(args: argparse.Namespace, out: TextIO) -> int:
    from .harness.cases import CaseFileError, read_case
    from .harness.standalone import standalone_test

    if args.output is not None:
        check_output_path(args.output, "-o")
    try:
        saved = read_case(args.case)
    except CaseFileError as exc:
        raise UsageError(str(exc)) from None
    source = standalone_test(saved, kernels=args.kernels, output=args.output, root=Path.cwd())
    if args.output is None:
        out.write(source)
        return EXIT_OK
    try:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(source, encoding="utf-8")
    except OSError as exc:  # the path was checked first; this is a race or a full disk
        raise UsageError(f"-o {args.output}: could not write it ({exc.strerror or exc})") from None
    print(f"wrote {args.output}", file=sys.stderr)
    return EXIT_OK


# ---------------------------------------------------------------- audit


def _config(args: argparse.Namespace) -> Any:
    """The configuration: the nearest pyproject.toml with [tool.exactref] (as pytest finds its own),
    overridden by the flags; its ``source`` attribute says where it came from, for the header."""
    from .harness.config import ConfigError, build, find_pyproject, read_pyproject

    kernels = args.kernels
    if args.backend is not None:
        if args.kernels is not None:
            raise UsageError(f"--backend {args.backend} and --kernels {args.kernels}: pass one of them")
        if args.backend not in BACKENDS:
            raise UsageError(f"--backend {args.backend!r}: the backends are {', '.join(BACKENDS)}; "
                             "pass --kernels MODULE for another kernel module")
        kernels = f"exactref.backends.{args.backend}"
    options = {"kernels": kernels, "strategies": args.strategies, "examples": args.examples,
               "device": args.device, "ops": args.ops, "formats": args.dtypes, "timeout": args.timeout,
               "regressions": str(args.regressions) if args.regressions else None}
    try:
        found = find_pyproject(Path.cwd())
        root = found if found is not None else Path.cwd()
        table = read_pyproject(root) if found is not None else None
        if table is not None and kernels is not None and args.regressions is None:
            # The saved cases there belong to the configured kernels, not to the ones given by --kernels.
            table = {k: v for k, v in table.items() if k != "regressions"}
        cfg = build(root, table, options)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    cfg.source = (f"[tool.exactref] in {root / 'pyproject.toml'}" if found is not None
                  else f"no [tool.exactref] in a pyproject.toml in {Path.cwd()} or above")
    return cfg


class Progress:
    """A one-line progress bar on a terminal; on a log, a line every tenth of the way."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self.total = total
        self.stream = stream
        self.tty = stream.isatty()
        self.start = time.perf_counter()
        self.done = 0
        self.examples = 0
        self._shown = -1
        self._last = 0.0

    def cell(self, name: str) -> None:
        self.current = name
        self._draw(force=True)

    def example(self) -> None:
        self.examples += 1
        self._draw()

    def finish_cell(self) -> None:
        self.done += 1
        self._draw(force=True)

    def _draw(self, force: bool = False) -> None:
        now = time.perf_counter()
        if self.tty:
            if not force and now - self._last < 0.1:
                return
            self._last = now
            width = 30
            filled = int(width * self.done / max(self.total, 1))
            bar = "#" * filled + "." * (width - filled)
            self.stream.write(f"\r[{bar}] {self.done}/{self.total} cells, {self.examples} examples, "
                              f"{now - self.start:5.1f}s  {getattr(self, 'current', '')[:40]:<40}")
            self.stream.flush()
            return
        tenth = 10 * self.done // max(self.total, 1)
        if force and tenth != self._shown:
            self._shown = tenth
            self.stream.write(f"[{'#' * tenth}{'.' * (10 - tenth)}] {self.done}/{self.total} cells, "
                              f"{self.examples} examples, {now - self.start:.1f}s\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def audit(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    cfg = _config(args)
    if cfg.examples is None:
        cfg.examples = DEFAULT_EXAMPLES
    if args.report is not None:
        from .harness.audit_report import check_report_path

        try:
            check_report_path(args.report)
        except (ValueError, ImportError) as exc:
            raise UsageError(str(exc)) from None
        check_output_path(args.report, "--report")
    from .harness.kernels import device_problem

    problem = device_problem(cfg.device)
    if problem:
        raise UsageError(f"--device {problem}")

    import warnings

    from .harness.kernels import ensure_importable, load_kernels

    ensure_importable(cfg.root)
    try:
        if cfg.strategies:
            import strategies as sx

            sx.load_module(cfg.strategies)
        kernels = load_kernels(cfg.kernels or DEFAULT_KERNELS, device=cfg.device)
    except (ImportError, ValueError, TypeError) as exc:
        raise UsageError(str(exc)) from None

    from .harness.suite import cells

    selected = cells(kernels, ops=cfg.ops, formats=cfg.formats)
    if not selected:
        raise UsageError(f"nothing to audit: the kernels of {cfg.kernels or DEFAULT_KERNELS} provide "
                         f"{', '.join(kernels) or 'no ops'} in formats that --ops/--dtypes leave out")
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2 ** 32)
    kernel_name = cfg.kernels or f"{DEFAULT_KERNELS} (PyTorch {_torch_version()} on {cfg.device})"
    print(f"exactref audit: {kernel_name}; {len(selected)} cells (op, format, direction), "
          f"{cfg.examples} examples each; seed {seed}", file=out)
    print(f"config: {cfg.source}", file=out)
    replayed = _replay(cfg, kernels, selected, out)
    out.flush()
    progress = Progress(len(selected), err)
    started = time.perf_counter()
    with warnings.catch_warnings():
        # Kernels and references may overflow on purpose (special values); their warnings are noise here.
        warnings.simplefilter("ignore", RuntimeWarning)
        runs, interrupted = _run_cells(selected, cfg, seed, progress)
    progress.close()
    elapsed = time.perf_counter() - started
    from .harness.audit_report import counterexamples, summary, table

    # The stopped cell is the last row, marked "interrupted".
    print(table(runs if interrupted is None else [*runs, interrupted]), file=out)
    print(counterexamples(runs), file=out, end="")
    print(_replay_failures(replayed), file=out, end="")
    status = summary(runs, elapsed, seed)
    still = [r for r in replayed if r.outcome in ("failed", "stale", "unreadable")]
    if still:
        n = len(still)
        lines = [line for line in status.text.splitlines() if not line.startswith("PASSED")]
        lines.append(f"FAILED: {n} saved regression case{'s' * (n != 1)} still fail{'s' * (n == 1)} "
                     "or cannot be replayed (listed above).")
        status.text, status.failed = "\n".join(lines), True
    print(_status_text(status.text, runs, interrupted, len(selected)), file=out)
    if cfg.regressions is not None:
        _save(runs, cfg, out)
    if interrupted is not None:
        if args.report is not None:
            print(f"{args.report} not written: the audit was interrupted", file=out)
        return EXIT_INTERRUPTED
    if args.report is not None:
        from .harness.audit_report import write_report

        write_report(args.report, runs, kernel_name=kernel_name, seed=seed, elapsed=elapsed)
        print(f"wrote {args.report}", file=out)
    return EXIT_MISMATCH if status.failed else EXIT_OK


class _CtrlC:
    """Ctrl-C during the audit: raised at once, and raised again at the next example if it was lost.

    Python only prints an exception raised inside a gc callback, and
    Hypothesis keeps one (``gc_callback``); a Ctrl-C landing there is
    therefore left to the next example instead of being raised.
    """

    def __init__(self, progress: Progress) -> None:
        self.pressed = False
        self.progress = progress

    def handler(self, signum: int, frame: Any) -> None:
        self.pressed = True
        if frame is None or frame.f_code.co_name != "gc_callback":
            raise KeyboardInterrupt

    def example(self) -> None:
        if self.pressed:
            raise KeyboardInterrupt
        self.progress.example()


def _run_cells(selected: list[Any], cfg: Any, seed: int, progress: Progress) -> tuple[list[Any], Any]:
    """The runs of the cells that finished, and the run of the one Ctrl-C stopped (None if none did)."""
    import signal
    import threading

    ctrl_c = _CtrlC(progress)
    # Only where Ctrl-C would interrupt anyway: a background job that ignores SIGINT keeps ignoring it.
    ours = signal.getsignal(signal.SIGINT) is signal.default_int_handler \
        and threading.current_thread() is threading.main_thread()
    if ours:
        signal.signal(signal.SIGINT, ctrl_c.handler)
    try:
        return _search(selected, cfg, seed, progress, ctrl_c)
    finally:
        if ours:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def _search(selected: list[Any], cfg: Any, seed: int, progress: Progress, ctrl_c: _CtrlC) -> tuple[list[Any], Any]:
    from .harness.suite import CellRun, audit_settings, run_cell

    runs: list[Any] = []
    began = (progress.examples, time.perf_counter())
    try:
        for cell in selected:
            progress.cell(cell.name)
            began = (progress.examples, time.perf_counter())
            run = run_cell(cell, base=audit_settings(), examples=cfg.examples, device=cfg.device,
                           seed_value=seed, shrink_seconds=SHRINK_SECONDS, on_example=ctrl_c.example,
                           timeout=cfg.timeout)
            if ctrl_c.pressed:
                # Ctrl-C landed where Hypothesis turned it into something else (seen under load as an
                # AssertionError of its engine): the cell was interrupted all the same, not failed.
                raise KeyboardInterrupt
            runs.append(run)
            progress.finish_cell()
    except KeyboardInterrupt:
        # What finished is kept: a long audit stopped late must not lose its results.  Ctrl-C may land
        # between cells too, so the stopped cell is the first one without a run.
        if len(runs) == len(selected):
            return runs, None
        examples = progress.examples - began[0] if getattr(progress, "current", None) == selected[len(runs)].name \
            else 0
        return runs, CellRun(selected[len(runs)], examples=examples, interrupted=True,
                             seconds=time.perf_counter() - began[1])
    return runs, None


def _status_text(text: str, runs: list[Any], interrupted: Any, total: int) -> str:
    from .harness.suite import no_longer_fails

    stale = [line for line in map(no_longer_fails, runs) if line]
    if stale:
        head, _, last = text.rpartition("\n")
        text = "\n".join([head, *stale, last] if head else [*stale, last])
    if interrupted is None:
        return text
    # "PASSED" would claim cells that never ran.
    lines = [line for line in text.splitlines() if not line.startswith("PASSED")]
    lines.append(f"INTERRUPTED: Ctrl-C stopped {interrupted.cell.name}; {len(runs)} of {total} cells finished, "
                 "and only they are reported above.")
    return "\n".join(lines)


def _replay(cfg: Any, kernels: Any, selected: list[Any], out: TextIO) -> list[Any]:
    """Replay the saved suite cases of the audited kernels in the selected cells' ops and formats, and say
    how many; [] without a directory."""
    if cfg.regressions is None:
        print("regression cases: none replayed (no regressions directory: set regressions in "
              "[tool.exactref], or pass --regressions DIR)", file=out)
        return []
    from .harness.replay import replay_directory

    module = cfg.kernels or DEFAULT_KERNELS
    wanted = {(c.op, c.fmt, c.direction) for c in selected}
    replayed = replay_directory(cfg.regressions, kernels, module=module, device=cfg.device, timeout=cfg.timeout,
                                root=cfg.root, cells=wanted)
    counts = {k: sum(r.outcome == k for r in replayed) for k in ("passed", "failed", "known", "skipped", "stale",
                                                                  "unreadable")}
    told = ", ".join(f"{n} {k}" for k, n in counts.items() if n and k != "passed")
    n = len(replayed)
    print(f"regression cases: {n} saved case{'s' * (n != 1)} of {module} replayed from {cfg.regressions}"
          f"{f' ({told})' if told else (' (all pass)' if n else '')}", file=out)
    return replayed


def _replay_failures(replayed: list[Any]) -> str:
    """The report of every saved case that still fails or cannot be replayed; empty when there is none."""
    blocks = [f"== {r.path.name}: {r.outcome if r.outcome != 'known' else 'known failure'}\n{r.text}"
              for r in replayed if r.outcome in ("failed", "known", "stale", "unreadable")]
    if not blocks:
        return ""
    return "\nSaved regression cases that still fail\n\n" + "\n\n".join(blocks) + "\n\n"


def _torch_version() -> str:
    try:
        import torch
    except ImportError:
        return "(not installed)"
    return str(torch.__version__)


def _save(runs: list[Any], cfg: Any, out: TextIO) -> None:
    from .harness.cases import unwritable, write_case
    from .harness.suite import suite_case

    for run in runs:
        for exc in run.failures:
            content = suite_case(run, exc, test=f"exactref::{run.cell.name}",
                                 kernels=cfg.kernels or DEFAULT_KERNELS)
            if content is None:
                continue
            try:
                print(f"saved {write_case(cfg.regressions, content)}", file=out)
            except OSError as error:
                # Once is enough: every other case would fail the same way.
                print(f"{unwritable(cfg.regressions, error)}; pass a writable directory with --regressions DIR",
                      file=out)
                return


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
