"""``[tool.exactref]`` in a kernel repository's pyproject.toml, merged with command-line options.

Only the standard library is imported at the top, so that reading the
configuration costs little; the names of the ops and formats are imported
when a configuration is built.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_TIMEOUT", "Config", "ConfigError", "find_pyproject", "read_pyproject"]

#: Every key ``[tool.exactref]`` may hold.
KEYS = ("kernels", "strategies", "regressions", "examples", "device", "suite", "ops", "formats", "timeout")
#: Seconds one kernel call may take before it is a failure, unless ``timeout`` says otherwise.
DEFAULT_TIMEOUT = 60.0


class ConfigError(ValueError):
    """A bad ``[tool.exactref]`` entry or option; the message names the key, the value and the file."""


@dataclass
class Config:
    """Where the kernels, the strategies and the regression cases are, and how hard to search."""

    root: Path
    kernels: str | None = None
    strategies: str | None = None
    regressions: Path | None = None
    examples: int | None = None
    device: str = "cpu"
    suite: bool = False
    ops: tuple[str, ...] | None = None
    formats: tuple[str, ...] | None = None
    # Seconds per kernel call; None: no limit.
    timeout: float | None = DEFAULT_TIMEOUT
    # Where the configuration came from, as the audit's header says it.
    source: str = ""


def _load_toml(path: Path, raw: bytes) -> dict[str, Any]:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise ConfigError(f"reading {path} needs the 'tomli' package on Python 3.10: "
                              "pip install tomli") from None
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except ValueError as exc:  # UnicodeDecodeError included
        raise ConfigError(f"cannot read {path}: {exc}") from None


def read_pyproject(root: Path, raw: bytes | None = None) -> dict[str, Any] | None:
    """The ``[tool.exactref]`` table of ``root/pyproject.toml``, or None when there is none.

    ``raw`` is the file's contents when the caller has read them already.
    """
    path = root / "pyproject.toml"
    if raw is None:
        try:
            raw = path.read_bytes()
        except OSError:
            return None
    # Skip parsing for the many repositories that never mention exactref.
    if b"exactref" not in raw:
        return None
    table = _load_toml(path, raw).get("tool", {}).get("exactref")
    if table is None:
        return None
    if not isinstance(table, dict):
        raise ConfigError(f"[tool.exactref] in {path} must be a table, not {table!r}")
    return table


def find_pyproject(start: Path) -> Path | None:
    """The nearest directory, ``start`` or one above it, whose pyproject.toml has ``[tool.exactref]``.

    As pytest finds its configuration: the first file up the tree that has
    the tool's table wins, so a subdirectory's own pyproject.toml without
    the table does not hide the repository's.
    """
    for directory in (start, *start.parents):
        if read_pyproject(directory) is not None:
            return directory
    return None


def _names(key: str, value: Any, where: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) and v.strip() for v in items):
        raise ConfigError(f"{key} = {value!r} ({where}) must be a list of names, e.g. ['matmul', 'sum']")
    return tuple(v.strip() for v in items)


def build(root: Path, table: dict[str, Any] | None, options: dict[str, Any]) -> Config:
    """The configuration from the pyproject table (may be None) overridden by non-None ``options``.

    ``options`` uses the same keys as the table.  Relative paths are relative
    to ``root``.
    """
    where = f"[tool.exactref] in {root / 'pyproject.toml'}"
    table = dict(table or {})
    unknown = sorted(set(table) - set(KEYS))
    if unknown:
        raise ConfigError(f"{where} has unknown keys {unknown}; the keys are: {', '.join(KEYS)}")
    merged: dict[str, Any] = {}
    given = set()
    for key in KEYS:
        if options.get(key) is not None:
            merged[key] = options[key]
            given.add(key)
        elif key in table:
            merged[key] = table[key]
    cfg = Config(root=root)

    def origin(key: str) -> str:
        return "on the command line" if key in given else where

    for key in ("kernels", "strategies", "device"):
        value = merged.get(key)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ConfigError(f"{key} = {value!r} ({origin(key)}) must be a non-empty string, "
                              "e.g. 'mykernels.exactref_kernels'")
        if value is not None:
            setattr(cfg, key, value.strip())
    regressions = merged.get("regressions")
    if regressions is not None:
        if not isinstance(regressions, (str, Path)) or not str(regressions).strip():
            raise ConfigError(f"regressions = {regressions!r} ({origin('regressions')}) must be a directory path, "
                              "e.g. 'tests/exactref_regressions'")
        path = Path(regressions)
        cfg.regressions = path if path.is_absolute() else root / path
    examples = merged.get("examples")
    if examples is not None:
        if isinstance(examples, str) and examples.isdigit():
            examples = int(examples)
        if isinstance(examples, bool) or not isinstance(examples, int) or examples < 1:
            raise ConfigError(f"examples = {examples!r} ({origin('examples')}) must be a whole number of at least 1")
        cfg.examples = examples
    suite = merged.get("suite", False)
    if not isinstance(suite, bool):
        raise ConfigError(f"suite = {suite!r} ({origin('suite')}) must be true or false")
    cfg.suite = suite
    cfg.timeout = _timeout(merged.get("timeout", DEFAULT_TIMEOUT), origin("timeout"))
    from .kernels import CELL_FORMATS, OP_INPUTS

    cfg.ops = _known("ops", merged.get("ops"), origin("ops"), "an op", tuple(OP_INPUTS))
    cfg.formats = _known("formats", merged.get("formats"), origin("formats"), "a format", CELL_FORMATS)
    return cfg


def _timeout(value: Any, where: str) -> float | None:
    """Seconds per kernel call, from a number or its text; 0 means no limit (None)."""
    number = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    if isinstance(number, bool) or not isinstance(number, (int, float)) or not 0 <= number < float("inf"):
        raise ConfigError(f"timeout = {value!r} ({where}) must be a number of seconds, at least 0 "
                          "(0 means no limit), e.g. timeout = 60")
    return float(number) or None


def _known(key: str, value: Any, where: str, kind: str, known: tuple[str, ...]) -> tuple[str, ...] | None:
    """The names of ``value`` (see :func:`_names`), each one of ``known``: a typo must not select nothing."""
    names = _names(key, value, where)
    for name in names or ():
        if name not in known:
            raise ConfigError(f"{key} names {name!r} ({where}), which is not {kind}; "
                              f"use names from: {', '.join(known)}")
    return names
