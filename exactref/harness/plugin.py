"""The pytest plugin at work: replaying regression cases, the property-suite items, saving failures.

:mod:`_exactref_pytestplugin` registers a :class:`Session` only when the
repository uses ExactRef; everything here is imported then.
"""

from __future__ import annotations

import functools
import inspect
from pathlib import Path
from typing import Any

import pytest

from ..errors import MismatchError, ReferenceUnavailableError
from .cases import (
    CaseFileError,
    SavedCase,
    arguments_of_test,
    content_of_test,
    scan,
    unwritable,
    write_case,
)
from .config import Config
from .judge import add_note, describe_inputs, first_line, flatten, is_keyed, keyed
from .kernels import Kernel, device_problem, ensure_importable, load_kernels
from .replay import replay_case, stale_reason

__all__ = ["Session"]

#: Seconds a suite item may spend after finding a failure (looking for others, shrinking).
SHRINK_SECONDS = 60.0
_SAVED = "exactref_saved"
_FIXED = "exactref_fixed"


class ExactRefError(Exception):
    """A problem an exactref item reports as its whole failure text (no traceback)."""


class SuiteFailure(Exception):
    """The failures one suite item found, with where each minimal case was saved."""


class _Collector(pytest.Collector):
    """The parent of the plugin's own items: their node ids read ``exactref::...``."""

    def collect(self) -> list[pytest.Item]:
        return []


class _Item(pytest.Item):
    def __init__(self, *, plugin: Session, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.plugin = plugin

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> Any:
        if isinstance(excinfo.value, (ExactRefError, SuiteFailure)):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.plugin.config.rootpath / "pyproject.toml", None, self.nodeid


class ErrorItem(_Item):
    """A configuration or case-file problem, reported as one failing item instead of a crash."""

    def __init__(self, *, message: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.message = message

    def runtest(self) -> None:
        raise ExactRefError(self.message)


class SuiteItem(_Item):
    """One cell of the built-in property suite: an op's kernel, in one format, forward or backward."""

    def __init__(self, *, cell: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cell = cell

    def runtest(self) -> None:
        from hypothesis import settings

        from .suite import no_longer_fails, run_cell

        cfg = self.plugin.cfg
        run = run_cell(self.cell, base=settings.default, examples=cfg.examples, device=cfg.device,
                       database_key=self.nodeid, shrink_seconds=SHRINK_SECONDS, timeout=cfg.timeout)
        if run.error is not None:
            raise ExactRefError(f"{self.cell.name}: the search could not run: {type(run.error).__name__}: "
                                f"{run.error}")
        if run.failures:
            known = self.cell.known_failure
            if known:
                # Not saved either: a known failure would only replay as one.
                pytest.xfail(f"known failure: {known}")
            raise SuiteFailure(self.plugin.report_suite_failures(self, run))
        if run.skipped:
            pytest.skip(run.skipped)
        stale = no_longer_fails(run)
        if stale:
            # As a strict xfail that passes: the entry now hides nothing but a working kernel.
            raise ExactRefError(stale)


class ReplayItem(_Item):
    """A saved case of the property suite, replayed against the kernel it failed on."""

    def __init__(self, *, saved: SavedCase, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.saved = saved
        self._exactref_replay = saved.path

    def runtest(self) -> None:
        data, path = self.saved.data, self.saved.path
        kernel = self.plugin.kernel_for_case(self.saved)
        note = f"Replayed from the regression case {self.plugin.rel(path)} (first found by {data['test']})."
        cfg = self.plugin.cfg
        try:
            replay_case(kernel, self.saved, device=cfg.device, timeout=cfg.timeout, note=note)
        except ReferenceUnavailableError as exc:
            pytest.skip(f"{self.plugin.rel(path)}: exactref has no decidable reference for this case: {exc}")
        except Exception as exc:
            members = flatten(exc)
            if not all(is_keyed(e) for e in members):
                raise
            known = kernel.known_failure(data["format"], data["direction"])
            if known:
                pytest.xfail(f"known failure: {known[1]}")
            text = "\n\n".join(str(e) for e in members)
            raise ExactRefError(f"Regression case {self.plugin.rel(path)} still fails:\n\n{text}") from None


class Session:
    """The plugin's state for one pytest run of a repository that uses ExactRef."""

    def __init__(self, config: pytest.Config, cfg: Config) -> None:
        self.config = config
        self.cfg = cfg
        self.kernels: dict[str, Kernel] | None = None
        # Why no kernel can run at all in this session, when that is so.
        self.blocked: str | None = None
        self._saved: list[tuple[str, str]] = []
        self._fixed: list[str] = []

    # ------------------------------------------------------------ reporting

    def header(self) -> str:
        cfg = self.cfg
        parts = [f"kernels {cfg.kernels or '(none)'}"]
        if cfg.strategies:
            parts.append(f"strategies {cfg.strategies}")
        parts.append(f"regressions {self.rel(cfg.regressions) if cfg.regressions else '(not saved)'}")
        parts.append("suite on" if cfg.suite else "suite off (--exactref runs it)")
        return "exactref: " + ", ".join(parts)

    def rel(self, path: Path | None) -> str:
        if path is None:
            return ""
        try:
            return str(path.relative_to(self.config.rootpath))
        except ValueError:
            return str(path)

    def save_problem(self, exc: OSError) -> str:
        """Why a case could not be written, and how to point the plugin elsewhere."""
        return (unwritable(Path(self.rel(self.cfg.regressions)), exc) + "; pass a writable directory with "
                "--exactref-regressions DIR or set regressions in [tool.exactref]")

    def report_suite_failures(self, item: SuiteItem, run: Any) -> str:
        """The failure text of a suite item; saves each minimal case on the way."""
        failures = run.failures
        blocks = []
        for i, exc in enumerate(failures, 1):
            saved = self._save_suite_case(item, run, exc)
            title = f"Failure {i} of {len(failures)}" if len(failures) > 1 else "Failure"
            where = getattr(type(exc), "where", None)
            kind = getattr(type(exc), "kind", type(exc).__name__)
            head = f"{title}: {kind} in {where}" if where else f"{title}: {type(exc).__name__}"
            body = str(exc)
            notes = [n for n in getattr(exc, "__notes__", []) if not n.startswith("Falsifying")]
            lines = [head, "", body]
            if notes:
                lines += ["", *notes]
            lines += ["", saved]
            blocks.append("\n".join(lines))
        if run.cut_short:
            blocks.append(f"(The search stopped {SHRINK_SECONDS:.0f} s after the first failure; each case "
                          "above is the smallest seen by then.)")
        return f"{item.cell.name}: {len(failures)} distinct failure{'s' if len(failures) > 1 else ''}, " \
               f"{run.examples} examples passed first\n\n" + "\n\n".join(blocks)

    def _save_suite_case(self, item: SuiteItem, run: Any, exc: BaseException) -> str:
        from .suite import suite_case

        content = suite_case(run, exc, test=item.nodeid, kernels=str(self.cfg.kernels))
        if content is None:
            return "Not saved: this is not a mismatch of the kernel."
        if self.cfg.regressions is None:
            return ("Not saved: no regressions directory (set regressions = \"tests/exactref_regressions\" "
                    "in [tool.exactref], or pass --exactref-regressions DIR).")
        try:
            path = write_case(self.cfg.regressions, content)
        except OSError as error:
            # The mismatch above is the news; a bad directory must not bury it under a traceback.
            return f"Not saved: {self.save_problem(error)}"
        item.user_properties.append((_SAVED, self.rel(path)))
        return (f"Saved as the regression case {self.rel(path)}; it replays first on every run. "
                f"`exactref to-pytest {self.rel(path)}` turns it into a standalone test.")

    # ------------------------------------------------------------ loading

    def kernel_for_case(self, saved: SavedCase) -> Kernel:
        rel = self.rel(saved.path)
        if self.blocked:
            raise ExactRefError(f"{rel}: cannot replay: {self.blocked}")
        if self.kernels is None:
            raise ExactRefError(f"{rel}: no kernel module is configured or it did not load, so this case "
                                "cannot replay")
        stale = stale_reason(saved, self.kernels, str(self.cfg.kernels), rel)
        if stale is not None:
            raise ExactRefError(stale)
        return self.kernels[saved.data["op"]]

    def _load(self, parent: _Collector) -> tuple[list[pytest.Item], bool]:
        """Import the kernel and strategy modules; a problem becomes an error item.

        Returns the error items, and whether the suite can run (the modules it needs loaded).
        """
        cfg = self.cfg
        problems: list[pytest.Item] = []
        ensure_importable(self.config.rootpath)
        if cfg.strategies:
            try:
                import strategies as sx

                sx.load_module(cfg.strategies)
            except Exception as exc:
                problems.append(ErrorItem.from_parent(parent, name="strategies", plugin=self,
                                                      message=f"exactref: {type(exc).__name__}: {exc}"))
        strategies_ok = not problems
        device = device_problem(cfg.device)
        if device:
            self.blocked = f"the device {device}"
            problems.append(ErrorItem.from_parent(parent, name="device", plugin=self,
                                                  message=f"exactref: {self.blocked}"))
            return problems, False
        if cfg.kernels:
            try:
                self.kernels = load_kernels(cfg.kernels, device=cfg.device)
            except Exception as exc:
                problems.append(ErrorItem.from_parent(parent, name="kernels", plugin=self,
                                                      message=f"exactref: {type(exc).__name__}: {exc}"))
        elif cfg.suite:
            problems.append(ErrorItem.from_parent(
                parent, name="kernels", plugin=self,
                message="exactref: --exactref runs the property suite against a kernel module, but none is "
                        "configured; set kernels = \"pkg.module\" in [tool.exactref] or pass --exactref-kernels"))
        return problems, strategies_ok and self.kernels is not None

    # ------------------------------------------------------------ hooks

    @pytest.hookimpl(wrapper=True)
    def pytest_collection_modifyitems(self, session: pytest.Session, config: pytest.Config,
                                      items: list[pytest.Item]) -> Any:
        # Added before the other plugins run, so that -k and -m select among them too.
        self._add_items(session, config, items)
        result = yield
        # Other plugins may reorder (pytest 9.2's fixture grouping does): replays still go first.
        front = [item for item in items if getattr(item, "_exactref_front", False)]
        items[:] = front + [item for item in items if not getattr(item, "_exactref_front", False)]
        return result

    def _add_items(self, session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
        parent = _Collector.from_parent(session, name="exactref", nodeid="exactref")
        front, suite_ready = self._load(parent)
        explicit = config.args_source == pytest.Config.ArgsSource.ARGS
        if self.cfg.regressions is not None:
            front += self._replays(parent, items, replay_suite=self.cfg.suite or not explicit)
        if self.cfg.suite and suite_ready:
            from .suite import cells

            for cell in cells(self.kernels, ops=self.cfg.ops, formats=self.cfg.formats):
                front.append(SuiteItem.from_parent(parent, name=cell.name, cell=cell, plugin=self))
        for item in items:
            self._capture(item)
        for item in front:
            item._exactref_front = True  # type: ignore[attr-defined]
        items[:] = front + items

    def _replays(self, parent: _Collector, items: list[pytest.Item], replay_suite: bool) -> list[pytest.Item]:
        out: list[pytest.Item] = []
        by_id = {item.nodeid: item for item in items}
        for path, saved in scan(self.cfg.regressions):
            name = f"regression[{path.name}]"
            if isinstance(saved, CaseFileError):
                out.append(ErrorItem.from_parent(parent, name=name, plugin=self,
                                                 message=f"exactref: {saved}".replace(str(path), self.rel(path))))
            elif saved.kind == "suite":
                if replay_suite:
                    out.append(ReplayItem.from_parent(parent, name=name, saved=saved, plugin=self))
            elif saved.test in by_id:
                item = by_id[saved.test]
                if getattr(getattr(item, "obj", None), "is_hypothesis_test", False):
                    out.append(self._test_replay(item, saved))
                else:
                    out.append(ErrorItem.from_parent(
                        parent, name=name, plugin=self,
                        message=f"exactref: regression case {self.rel(path)} is stale: its test {saved.test} is "
                                "no longer a Hypothesis test, so the saved arguments cannot be given to it"))
            elif self._test_is_gone(saved.test, items):
                out.append(ErrorItem.from_parent(
                    parent, name=name, plugin=self,
                    message=f"exactref: regression case {self.rel(path)} is stale: its test {saved.test} no "
                            "longer exists; delete the file, or rename it along with the test"))
        return out

    @staticmethod
    def _test_is_gone(test: str, items: list[pytest.Item]) -> bool:
        """Whether the test's file was collected but no longer defines the test."""
        file, _, rest = test.partition("::")
        module_item = next((i for i in items if i.nodeid.partition("::")[0] == file
                            and isinstance(i, pytest.Function)), None)
        if module_item is None:
            return False
        obj: Any = module_item.module
        for part in rest.split("[", 1)[0].split("::"):
            obj = getattr(obj, part, None)
            if obj is None:
                return True
        return False

    def _test_replay(self, item: pytest.Item, saved: SavedCase) -> pytest.Item:
        """A copy of a repository test that runs its body once, on the saved case, without Hypothesis."""
        try:
            drawn = arguments_of_test(saved)
        except Exception as exc:
            return ErrorItem.from_parent(item.parent, name=f"{item.name}[exactref-regression]", plugin=self,
                                         message=f"exactref: regression case {self.rel(saved.path)}: {exc}")
        inner = getattr(item.obj.hypothesis.inner_test, "__wrapped__", item.obj.hypothesis.inner_test)
        where = self.rel(saved.path)

        def replay(*args: Any, **kwargs: Any) -> None:
            __tracebackhide__ = True
            try:
                inner(*args, **kwargs, **drawn)
            except BaseException as exc:
                if isinstance(exc, Exception):
                    add_note(exc, f"(replaying the regression case {where})")
                raise

        replay.__signature__ = inspect.signature(item.obj)  # type: ignore[attr-defined]
        digest = saved.name.rsplit("-", 1)[-1]
        # No originalname: pytest 9.2 builds the node id from it (and the callspec), which would give
        # the replay the test's own id.
        func = pytest.Function.from_parent(item.parent, name=f"{item.originalname}[exactref-regression-{digest}]",
                                           callobj=replay, callspec=getattr(item, "callspec", None),
                                           fixtureinfo=getattr(item, "_fixtureinfo", None))
        func._exactref_replay = saved.path  # type: ignore[attr-defined]
        return func

    def _capture(self, item: pytest.Item) -> None:
        """Wrap a Hypothesis test's body so that a failing OpCase it drew can be saved."""
        obj = getattr(item, "obj", None)
        handle = getattr(obj, "hypothesis", None)
        if not getattr(obj, "is_hypothesis_test", False) or handle is None:
            return
        inner = handle.inner_test
        if getattr(inner, "_exactref_wrapped", False):
            return
        fixtures = set(inspect.signature(obj).parameters)

        @functools.wraps(inner)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            try:
                return inner(*args, **kwargs)
            except Exception as exc:
                drawn = {k: v for k, v in kwargs.items() if k not in fixtures}
                cases = {k: v for k, v in drawn.items() if type(v).__name__ == "OpCase"}
                if cases:
                    exc._exactref_args = drawn  # type: ignore[attr-defined]
                    if isinstance(exc, MismatchError) and not is_keyed(exc) and exc.op:
                        # Told apart by op and gradient too, not only by kind (see _judge).
                        exc.__class__ = keyed(type(exc), exc.op)
                    for name, case in cases.items():
                        add_note(exc, f"{name} ({case.op}), exactly:\n"
                                      f"{describe_inputs(case.inputs, case.kwargs, case.grad, 'backward')}")
                raise

        wrapper._exactref_wrapped = True  # type: ignore[attr-defined]
        handle.inner_test = wrapper

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        report = yield
        if call.when != "call":
            return report
        replayed = getattr(item, "_exactref_replay", None)
        if replayed is not None:
            if report.passed:
                report.user_properties.append((_FIXED, self.rel(replayed)))
            return report
        if call.excinfo is None or self.cfg.regressions is None:
            return report
        for exc in flatten(call.excinfo.value):
            drawn = getattr(exc, "_exactref_args", None)
            if drawn is None:
                continue
            try:
                content = content_of_test(test=item.nodeid, arguments=drawn, failure=first_line(exc))
            except TypeError as err:
                report.sections.append(("exactref", f"The failing case was not saved: {err}"))
                continue
            try:
                path = write_case(self.cfg.regressions, content)
            except OSError as err:
                report.sections.append(("exactref", f"The failing case was not saved: {self.save_problem(err)}"))
                continue
            report.user_properties.append((_SAVED, self.rel(path)))
            report.sections.append(("exactref", f"Saved the minimal failing case as {self.rel(path)}; "
                                                "it replays first on every run."))
        return report

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call":
            return
        for key, value in report.user_properties:
            if key == _SAVED:
                self._saved.append((str(value), report.nodeid))
            elif key == _FIXED:
                self._fixed.append(str(value))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not (self._saved or self._fixed):
            return
        tr = terminalreporter
        tr.section("exactref")
        if self._saved:
            tr.write_line(f"Saved {len(set(self._saved))} minimal failing case(s); review and commit them, "
                          "they replay first on every run:")
            for path, nodeid in sorted(set(self._saved)):
                tr.write_line(f"  {path}  ({nodeid})")
        if self._fixed:
            tr.write_line(f"Fixed: {len(set(self._fixed))} saved case(s) now pass; keep them as regression tests, "
                          "or delete them:")
            for path in sorted(set(self._fixed)):
                tr.write_line(f"  {path}")
