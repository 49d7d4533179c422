"""ExactRef's pytest plugin, loaded by pytest through the ``pytest11`` entry point.

A top-level module, not part of the ``exactref`` package, so that loading it
imports neither exactref nor numpy (as Hypothesis does with its own plugin).
It stays out of the way: unless the repository has a ``[tool.exactref]``
table or an ``--exactref`` option is given, the only work it does is to look
for the word "exactref" in pyproject.toml.  When it is in use it

* replays the saved regression cases first, each as its own test item;
* with ``--exactref`` (or ``suite = true``), runs the built-in property
  suite against the configured kernels, one item per op, format and direction;
* saves the minimal failing case of every failing suite item, and of every
  failing Hypothesis test of the repository that draws an ``OpCase``.

See ``docs/plugin.md``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

#: The option group, and every option of the plugin.
GROUP = "exactref"
SUITE = "--exactref"
KERNELS = "--exactref-kernels"
STRATEGIES = "--exactref-strategies"
REGRESSIONS = "--exactref-regressions"
EXAMPLES = "--exactref-examples"
DEVICE = "--exactref-device"
TIMEOUT = "--exactref-timeout"

_PLUGIN_NAME = "exactref-session"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup(GROUP, "ExactRef: exact references for numerical kernels")
    group.addoption(SUITE, action="store_true", default=None, dest="exactref_suite",
                    help="also run ExactRef's built-in property suite against the configured kernels")
    group.addoption(KERNELS, metavar="MODULE", default=None, dest="exactref_kernels",
                    help="the kernel module (defines EXACTREF_KERNELS); overrides [tool.exactref] kernels")
    group.addoption(STRATEGIES, metavar="MODULE", default=None, dest="exactref_strategies",
                    help="a module that registers strategies per op; overrides [tool.exactref] strategies")
    group.addoption(REGRESSIONS, metavar="DIR", default=None, dest="exactref_regressions",
                    help="where minimal failing cases are saved and replayed from")
    group.addoption(EXAMPLES, metavar="N", type=int, default=None, dest="exactref_examples",
                    help="examples per suite item (default: the Hypothesis profile's max_examples)")
    group.addoption(DEVICE, metavar="DEVICE", default=None, dest="exactref_device",
                    help="the torch device kernels get their tensors on (default: cpu)")
    group.addoption(TIMEOUT, metavar="SECONDS", default=None, dest="exactref_timeout",
                    help="seconds one kernel call may take before it is a failure (default 60; 0: no limit)")


def _pyproject_bytes(root: Path) -> bytes | None:
    try:
        return (root / "pyproject.toml").read_bytes()
    except OSError:
        return None


def pytest_configure(config: pytest.Config) -> None:
    options = {
        "suite": config.getoption("exactref_suite"),
        "kernels": config.getoption("exactref_kernels"),
        "strategies": config.getoption("exactref_strategies"),
        "regressions": config.getoption("exactref_regressions"),
        "examples": config.getoption("exactref_examples"),
        "device": config.getoption("exactref_device"),
        "timeout": config.getoption("exactref_timeout"),
    }
    raw = _pyproject_bytes(config.rootpath)
    # Most repositories never mention exactref: for them, nothing more is imported or parsed.
    if all(v is None for v in options.values()) and (raw is None or b"exactref" not in raw):
        return
    from exactref.harness.config import ConfigError, build, read_pyproject
    from exactref.harness.plugin import Session

    try:
        table = read_pyproject(config.rootpath, raw)
        if table is None and all(v is None for v in options.values()):
            return
        settings = build(config.rootpath, table, options)
    except ConfigError as exc:
        raise pytest.UsageError(f"exactref: {exc}") from None

    config.pluginmanager.register(Session(config, settings), _PLUGIN_NAME)


def pytest_report_header(config: pytest.Config) -> Any:
    session = config.pluginmanager.get_plugin(_PLUGIN_NAME)
    return session.header() if session is not None else None
