"""A sample kernel repository with plantable bugs, copied fresh for each test, and ways to run it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

SAMPLE = Path(__file__).resolve().parent / "sample_repo"
# The sample repository holds tests of its own; they run inside it, not here.
collect_ignore = ["sample_repo", "triton_repo"]


def kernel_module(monkeypatch: pytest.MonkeyPatch, name: str, **attributes: object) -> types.ModuleType:
    """A module ``name`` holding ``attributes`` (EXACTREF_KERNELS, say), importable until the test ends."""
    mod = types.ModuleType(name)
    mod.__dict__.update(attributes)
    monkeypatch.setitem(sys.modules, name, mod)
    return mod


class Repo:
    """A copy of the sample kernel repository in a temporary directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.regressions = root / "tests" / "exactref_regressions"

    def plant(self, *bugs: str) -> None:
        """Switch on exactly these planted bugs (none: the kernels are fixed)."""
        (self.root / "mykernels" / "bugs.py").write_text(f"BUGS = {set(bugs)!r}\n" if bugs else "BUGS = set()\n")

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """``python -m pytest`` in the repository, as its CI would run it."""
        return self.command(sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-W",
                            "ignore::DeprecationWarning", "-q", *args, timeout=timeout)

    def audit(self, *args: str, timeout: float = 200) -> subprocess.CompletedProcess[str]:
        return self.command(sys.executable, "-m", "exactref.cli", "audit", *args, timeout=timeout)

    def command(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_PROFILE"}
        return subprocess.run(argv, cwd=self.root, capture_output=True, text=True, timeout=timeout, env=env)

    def cases(self) -> list[dict]:
        """Every saved regression case, parsed."""
        return [json.loads(p.read_text()) for p in sorted(self.regressions.glob("*.json"))]


@pytest.fixture
def repo(tmp_path: Path) -> Repo:
    root = tmp_path / "repo"
    shutil.copytree(SAMPLE, root, ignore=shutil.ignore_patterns("__pycache__", ".hypothesis", "exactref_regressions"))
    r = Repo(root)
    r.plant()
    return r


def output(result: subprocess.CompletedProcess[str]) -> str:
    return result.stdout + result.stderr
